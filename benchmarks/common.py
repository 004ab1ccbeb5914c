"""Model shapes shared by the benchmarks, defined once so that their numbers compare."""

from flaxformer_lite.config.model import ModelConfig

# 256 wide, 3+3 layers, 4 heads, FFN 1024, vocab 8000: configs/ende_small.py's sizes, with
# the paper's post-LN and dropout 0.1 (ende_small trains pre-LN with dropout 0.2).
TINY = ModelConfig(
    vocab_size=8000,
    d_model=256,
    num_heads=4,
    d_ff=1024,
    num_encoder_layers=3,
    num_decoder_layers=3,
    max_len=256,
)
# The paper's base shape with the same vocabulary.
BASE_LIKE = ModelConfig(
    vocab_size=8000,
    d_model=512,
    num_heads=8,
    d_ff=2048,
    num_encoder_layers=6,
    num_decoder_layers=6,
    max_len=256,
)
