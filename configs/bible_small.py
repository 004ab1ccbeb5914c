"""A small EN->ES Transformer on the KJV / Reina-Valera 1909 verse pairs.

  python -m flaxformer_lite.main --config=configs/bible_small.py --workdir=runs/bible

Test books (Ruth, Jonah, Titus, Philemon, Jude) are never seen in training.
Verses are longer than the Ding sentences: rows of 128 tokens.
"""

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
    )
    config = base_config(model)
    config.data.dataset = "bible_en_es"
    config.data.source_lang, config.data.target_lang = "en", "es"
    config.data.max_length = 128
    config.train.batch_size = 16
    config.train.num_steps = 2000
    config.train.eval_every = 500
    config.train.checkpoint_every = 500
    config.optimizer.warmup_steps = 400
    config.optimizer.learning_rate = 2.0
    config.optimizer.clip_grad_norm = 1.0
    return apply_variants(config, arg).lock()
