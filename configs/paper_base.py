"""The paper's base Transformer (Vaswani et al. 2017, Table 3, 'base') and its recipe.

  python -m flaxformer_lite.main --config=configs/paper_base.py --workdir=runs/base \\
      --config.data.dataset=wmt14_translate/de-en   # with internet; TFDS downloads it

6+6 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.1, post-LN, sinusoidal
positions, source/target/softmax embeddings shared and scaled by sqrt(d_model);
Adam(0.9, 0.98, 1e-9), noam schedule with 4000 warmup steps, label smoothing
0.1, 100k steps. With the 37,000-token vocabulary: 63,082,496 parameters
(the paper rounds to 65M). The paper's batches held ~25k source + 25k target
tokens; here 400 packed rows of 64 (adjust to your accelerator).
"""

from flaxformer_lite.config import PRESETS, apply_variants, base_config


def get_config(arg: str | None = None):
    config = base_config(PRESETS["paper_base"])
    config.data.max_length = 64
    config.train.batch_size = 400
    config.train.num_steps = 100_000
    return apply_variants(config, arg).lock()
