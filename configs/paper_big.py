"""The paper's big Transformer (Vaswani et al. 2017, Table 3, 'big', EN-DE).

  python -m flaxformer_lite.main --config=configs/paper_big.py --workdir=runs/big

6+6 layers, d_model 1024, 16 heads, d_ff 4096, dropout 0.3 (EN-DE; the paper
used 0.1 for EN-FR: --config.model.residual_dropout=0.1
--config.model.embedding_dropout=0.1), 300k steps. With 37,000 tokens:
214,245,376 parameters (the paper: 213M).
"""

from flaxformer_lite.config import PRESETS, apply_variants, base_config


def get_config(arg: str | None = None):
    config = base_config(PRESETS["paper_big"])
    config.data.max_length = 64
    config.train.batch_size = 400
    config.train.num_steps = 300_000
    return apply_variants(config, arg).lock()
