"""The KJV running-text LM of the sparse-vs-dense comparison, at a chosen context.

  --config=experiments/sparse_vs_dense_lm/config.py:1024     (or :4096; add ,debug)

A small decoder-only LM (128 wide, 3 layers, 4 heads, pre-LN, 8k pieces) on the
King James Version read as one running text (data.stream), rows of the context
length, 4,096 tokens a step whatever the context, 120 steps (a fixed budget of
0.5M tokens, about half the text: what 2 CPU cores allow for 15 runs). The sweep in run.sh
varies model.attention_pattern; everything else is equal, so the runs differ
only in which keys each query reads.
"""

from flaxformer_lite.config import ModelConfig, apply_variants, base_config

TOKENS_PER_STEP = 4096


def get_config(arg: str | None = None):
    parts = [p for p in (arg or "").split(",") if p]
    lengths = [int(p) for p in parts if p.isdigit()]
    length = lengths[0] if lengths else 1024
    model = ModelConfig(
        vocab_size=8000,
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_encoder_layers=0,
        num_decoder_layers=3,
        max_len=length,
        ln_position="pre",
        attention_block_size=64,
    )
    config = base_config(model)
    config.data.task = "lm"
    config.data.dataset = "bible_en_es"
    config.data.target_lang = "en"
    config.data.stream = True
    config.data.max_length = length
    config.data.tokenizer_max_sentences = 200_000
    config.train.batch_size = max(TOKENS_PER_STEP // length, 1)
    config.train.num_steps = 120
    config.train.log_every = 20
    config.train.eval_every = 20
    config.train.checkpoint_every = 40
    config.train.eval_batches = 4
    config.optimizer.warmup_steps = 40
    config.optimizer.learning_rate = 0.5  # noam peak 0.5 * 128^-0.5 * 40^-0.5 = 7.0e-3
    config.optimizer.clip_grad_norm = 1.0
    config = apply_variants(config, ",".join(p for p in parts if not p.isdigit()) or None)
    return config.lock()
