"""The lab's experiment: the demo's small EN->DE Transformer, with the lab's
extension (``my_ext.py`` beside this file) named in ``model.extensions``.

  python -m flaxformer_lite.main --config=examples/lab/config.py --workdir=runs/lab/swiglu \
      --config.model.ffn=swiglu
  python -m flaxformer_lite.main sweep --config=examples/lab/config.py --workdir=runs/lab \
      --sweep=model.ffn=standard,swiglu --seeds=3 --baseline=model.ffn=standard

``:debug`` makes it a seconds-long run (the test runs these commands so). The
extension's path is taken from this file's own place, so the commands work from any
folder and after the lab folder moves.
"""

from pathlib import Path

from flaxformer_lite.config import ModelConfig, apply_variants, base_config


def get_config(arg: str | None = None):
    model = ModelConfig(
        vocab_size=8000,
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=3,
        num_decoder_layers=3,
        max_len=256,
        embedding_dropout=0.2,
        residual_dropout=0.2,
        attention_dropout=0.0,  # the sparse kernels have none: one baseline for all
        ln_position="pre",
    )
    config = base_config(model)
    # The lab's names become valid values once this is imported (by every command):
    config.model.extensions = str(Path(__file__).resolve().with_name("my_ext.py"))
    # The demo's data recipe (configs/ende_small.py says why): dictionary phrases as
    # extra pairs, drawn anew each epoch, and PPMI-initialised embeddings.
    config.data.train_splits = "train,train_phrases:8000"
    config.data.aux_min_count = 2
    config.data.aux_tag = "<dict>"
    config.data.resample_subsets = True
    config.data.max_length = 64
    config.train.embedding_init = "ppmi"
    config.train.embedding_init_splits = "train,train_phrases"
    config.train.batch_size = 32
    config.train.concurrent_splits = 2
    # Equal steps for every point, whatever the machine's load (no wall-clock budget):
    # 600 steps is ~6 minutes on 2 CPU cores, where the demo's model reaches ~5.5 BLEU.
    config.train.max_minutes = 0.0
    config.train.num_steps = 600
    config.train.log_every = 20
    config.train.eval_every = 100
    config.train.checkpoint_every = 100
    config.train.eval_bleu_sentences = 128
    config.optimizer.warmup_steps = 200
    config.optimizer.learning_rate = 1.0
    config.optimizer.clip_grad_norm = 1.0
    config.optimizer.ema_decay = 0.99
    return apply_variants(config, arg).lock()
