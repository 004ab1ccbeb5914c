"""The paper's big Transformer (Vaswani et al. 2017, Table 3, row 'big', EN-DE).

  python -m flaxformer_lite.main --config=configs/paper_big.py --workdir=runs/big

6+6 layers, d_model 1024, 16 heads, d_ff 4096, dropout 0.3 (EN-DE; the paper
used 0.1 for EN-FR: --config.model.residual_dropout=0.1
--config.model.embedding_dropout=0.1). With 37,000 tokens: 214,245,376
parameters (the paper: 213M).
"""

import ml_collections

from flaxformer_lite.config import PRESETS, model_config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(PRESETS["paper_big"])
    return config.lock()
