"""The default experiment: a small EN->DE Transformer on the Ding sentence pairs.

  python -m flaxformer_lite.main --config=configs/ende_small.py --workdir=runs/ende_small
  python -m flaxformer_lite.main --config=configs/ende_small.py:debug --workdir=/tmp/dbg

Sized to train on 2 CPU cores in about 10 minutes: 256 wide, 3+3 layers,
4 heads, d_ff 1024, an 8k joint sentencepiece vocabulary, packed rows of 64
tokens. The paper's recipe otherwise: post-LN, sinusoids, tied embeddings,
Adam(0.9, 0.98, 1e-9) with the noam schedule, label smoothing 0.1.
"""

from flaxformer_lite.config import ModelConfig
from flaxformer_lite.experiment import apply_variants, base_config


def get_config(arg: str | None = None):
    model = ModelConfig(
        vocab_size=8000,  # joint EN+DE sentencepiece; ~19k pairs do not support more
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=3,
        num_decoder_layers=3,
        max_len=256,
        embedding_dropout=0.1,
        residual_dropout=0.1,
    )
    config = base_config(model)
    config.data.max_length = 64  # packed row length; 99% of sentences are < 35 pieces
    config.train.batch_size = 32  # rows of 64 tokens: ~2k target tokens a step
    config.train.num_steps = 1000
    config.train.log_every = 20
    config.train.eval_every = 250
    config.train.checkpoint_every = 250
    config.optimizer.warmup_steps = 300  # a short run: the paper's 4000 would never finish warming
    config.optimizer.learning_rate = 2.0  # noam multiplier; peak 2 * 256^-0.5 * 300^-0.5 = 7.2e-3
    config.optimizer.clip_grad_norm = 1.0
    return apply_variants(config, arg).lock()
