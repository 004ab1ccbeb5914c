"""A small decoder-only language model on the English King James Version.

  python -m flaxformer_lite.main --config=configs/lm_small.py --workdir=runs/lm_small

The same decoder layers as the Transformer, without cross-attention: 256
wide, 4 layers, 4 heads, d_ff 1024, pre-LN, an 8k sentencepiece vocabulary of the KJV
training books, verses packed into rows of 128 tokens. Validation is on the
held-out books of bible_en_es (Obadiah, Haggai, 2 and 3 John). With the paper's
post-LN and a noam multiplier of 2.0 the run diverged after step 500 (validation
perplexity 99 at 500, 181 at 1,000); pre-LN at 1.0: 49 at 500.
"""

from flaxformer_lite.config import ModelConfig, apply_variants, base_config


def get_config(arg: str | None = None):
    model = ModelConfig(
        vocab_size=8000,
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=0,
        num_decoder_layers=4,
        max_len=256,
        ln_position="pre",
    )
    config = base_config(model)
    config.data.task = "lm"
    config.data.dataset = "bible_en_es"
    config.data.target_lang = "en"  # the text the LM reads
    config.data.max_length = 128
    config.train.batch_size = 16
    config.train.num_steps = 2000
    config.train.eval_every = 500
    config.train.checkpoint_every = 500
    config.optimizer.warmup_steps = 400
    config.optimizer.learning_rate = 1.0
    config.optimizer.clip_grad_norm = 1.0
    return apply_variants(config, arg).lock()
