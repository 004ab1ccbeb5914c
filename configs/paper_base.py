"""The paper's base Transformer (Vaswani et al. 2017, Table 3, row 'base').

  python -m flaxformer_lite.main --config=configs/paper_base.py --workdir=runs/base

6+6 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.1, post-LN, sinusoidal
positions, source/target/softmax embeddings shared and scaled by sqrt(d_model).
With the 37,000-token vocabulary: 63,082,496 parameters (the paper rounds to 65M).
"""

import ml_collections

from flaxformer_lite.config import PRESETS, model_config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # variants (':debug') arrive with the training configs
    config = ml_collections.ConfigDict()
    # Every model field with the paper's value; see flaxformer_lite/config.py for each.
    config.model = model_config_dict(PRESETS["paper_base"])
    return config.lock()
