"""The experiments' translation setup: a small EN->DE Transformer on the Ding pairs,
a fixed number of steps, a few minutes a run on 2 CPU cores.

  python -m flaxformer_lite.main --config=configs/ding_mini.py --workdir=runs/mini
  python -m flaxformer_lite.main sweep --config=configs/ding_mini.py \\
      --sweep=model.num_heads=1,2,4,8 --seeds=3 --workdir=runs/sweeps/heads

The paper's base model in miniature: post-LN, sinusoids, tied embeddings, ReLU,
dropout 0.1, label smoothing 0.1, Adam(0.9, 0.98, 1e-9) and the noam schedule,
scaled down to 128 wide, 2+2 layers, 4 heads (d_k 32), d_ff 512, a 4k joint
vocabulary, packed rows of 64 tokens, 32 rows a step. Only the sentence pairs
(no dictionary phrases, no PPMI embedding start: those are the default recipe's,
see experiments/translation_recipe) so that every ablation changes one thing.
A fixed step budget (not minutes), so that a run gives the same numbers on any
machine; BLEU is scored afterwards by the sweep (beam 4, alpha 0.6).
"""

from flaxformer_lite.config import ModelConfig, apply_variants, base_config


def get_config(arg: str | None = None):
    model = ModelConfig(
        vocab_size=4000,
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_encoder_layers=2,
        num_decoder_layers=2,
        max_len=256,
    )
    config = base_config(model)
    config.data.max_length = 64
    config.train.batch_size = 32
    config.train.num_steps = 600
    config.train.log_every = 25
    config.train.eval_every = 100
    config.train.checkpoint_every = 300
    config.train.eval_bleu_sentences = 0
    config.optimizer.warmup_steps = 200
    config.optimizer.learning_rate = 1.0  # noam peak 128^-0.5 * 200^-0.5 = 6.25e-3
    return apply_variants(config, arg).lock()
