"""Long-range tasks: a small model on generated recall and classification tasks.

  python -m flaxformer_lite.main --config=experiments/long_range/config.py:mqar,l512,p32 \\
      --workdir=runs/lr --config.model.attention_pattern=local:window=32

``get_config("TASK,lL[,pP][,kK]")``: ``mqar`` (multi-query associative recall, P pairs
of keys and values drawn from K symbols each, default 128),
``needle`` (one query at a controlled distance; K symbols too) or ``listops``
(classification) at
row length L (data/synthetic.py). The model: 2 layers, 64 wide, 2 heads, d_ff 256,
pre-LN, no dropout, rotary positions, embeddings neither scaled by sqrt(d) nor tied to
the output (the calibration in this folder's README: with the paper's scaled, tied
embeddings and absolute positions the dense model stays at chance on recall); Adam
with a constant rate after warm-up: 3e-3 for ListOps, 1e-3 for recall (at 3e-3 the
dense model plateaus on recall where 1e-3 learns it: the README's calibration).
Variants: ``debug`` (a few steps).
"""

from flaxformer_lite.config import ModelConfig, apply_variants, base_config
from flaxformer_lite.data import synthetic


def get_config(arg: str | None = None):
    parts = [p for p in (arg or "mqar,l512,p32").split(",") if p]
    variants = [p for p in parts if p in ("debug",)]
    task = next((p for p in parts if p in synthetic.TASK_OF), "mqar")
    length = int(next((p[1:] for p in parts if p.startswith("l") and p[1:].isdigit()), 512))
    pairs = int(next((p[1:] for p in parts if p.startswith("p") and p[1:].isdigit()), 32))
    symbols = int(next((p[1:] for p in parts if p.startswith("k") and p[1:].isdigit()), 128))
    dataset = f"{task}/l{length}" + (f"_p{pairs}" if task == "mqar" else "")
    if task != "listops" and symbols != synthetic.KEYS:
        dataset += f"_k{symbols}"
    classify = synthetic.TASK_OF[task] == "classify"
    model = ModelConfig(
        vocab_size=synthetic.VOCAB[task],
        d_model=64,
        num_heads=2,
        d_ff=256,
        num_encoder_layers=2 if classify else 0,
        num_decoder_layers=0 if classify else 2,
        max_len=length,
        embedding_dropout=0.0,
        residual_dropout=0.0,
        ln_position="pre",
        positional="rotary",
        scale_embeddings=False,
        tie_embeddings="none",
        num_classes=synthetic.NUM_CLASSES.get(task, 0),
        attention_block_size=64,
    )
    config = base_config(model)
    config.data.task = synthetic.TASK_OF[task]
    config.data.dataset = dataset
    config.data.max_length = length
    config.data.pack = False
    config.train.batch_size = 32
    config.train.num_steps = 1000
    config.train.log_every = 50
    config.train.eval_every = 250
    config.train.checkpoint_every = 500
    config.train.label_smoothing = 0.0
    config.train.best_metric = "accuracy"
    config.optimizer.schedule = "constant"
    config.optimizer.learning_rate = 1e-3 if config.data.task == "recall" else 3e-3
    config.optimizer.warmup_steps = 100
    config.optimizer.clip_grad_norm = 1.0
    return apply_variants(config, ",".join(variants)).lock()
