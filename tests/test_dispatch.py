"""The dispatch table (sparse/dispatch.py): every pattern family under every
attention_impl is a kernel or a refusal that says what to use, the model runs the
kernel the table names, and the config refuses what the table refuses."""

import jax.numpy as jnp
import pytest

from flaxformer_lite.config.fields import ConfigError
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import head_groups, kernels
from flaxformer_lite.sparse import dispatch
from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P

# A pattern of each family (block 16: the routed Triton kernel's smallest tile).
EXAMPLES = {
    "dense": None,
    "full": P.Full().causal(),
    "causal_window": P.Local(8).causal(),
    "window": P.Local(8),
    "static": P.bigbird(16, 3, 1, 1),
    "routed": D.MoBA(16, 2).causal(),
    "topk": D.TopK(8),
}


def test_the_table_is_whole_and_each_refusal_names_a_fix():
    assert set(dispatch.TABLE) == set(dispatch.FAMILIES) == set(EXAMPLES)
    for family, row in dispatch.TABLE.items():
        assert len(row) == len(dispatch.IMPLS), family
        for impl, cell in zip(dispatch.IMPLS, row, strict=True):
            assert cell in dispatch.KERNELS or "use " in cell, (family, impl, cell)
    assert {dispatch.family(p) for p in EXAMPLES.values()} == set(EXAMPLES)
    assert dispatch.family(D.NSA(16, 2, 20)) == "routed"
    assert dispatch.family(P.Local(8).causal() | P.Strided(8)) == "static"
    assert dispatch.family(P.Full()) == "full"


def test_a_routed_block_the_triton_kernel_cannot_tile_is_refused():
    assert dispatch.kernel(D.MoBA(32, 2), "cudnn") == "routed"
    with pytest.raises(dispatch.Refused, match="block=24 is no power of two >= 16"):
        dispatch.kernel(D.MoBA(24, 2), "cudnn")
    assert dispatch.kernel(D.MoBA(24, 2), "blocked") == "routed_xla"
    with pytest.raises(dispatch.Refused, match="choose one of"):
        dispatch.kernel(P.Full(), "flash")


# What head_groups calls for each kernel of the table, and how the call is told apart.
CALLS = {
    "cudnn": (kernels, "cudnn_attention"),
    "splash": (kernels, "splash_attention"),
    "band": (head_groups, "band_attention"),
    "block_sparse": (head_groups, "block_sparse_attention"),
    "blocked": (head_groups, "sparse_attention"),
    "dense_mask": (head_groups, "masked_dense_attention"),
    "routed": (head_groups, "_dynamic"),
    "routed_xla": (head_groups, "_dynamic"),
    "topk": (head_groups, "topk_attention"),
}


@pytest.mark.parametrize("impl", dispatch.IMPLS)
def test_the_model_runs_the_kernel_the_table_names(impl, monkeypatch):
    """Each head group goes to the function of the kernel the table gives its family
    (the functions replaced by recorders: this checks the routing, the kernels' own
    tests check their values)."""
    monkeypatch.setattr(kernels, "platform_mode", lambda _: "xla")
    q = jnp.zeros((1, 32, 2, 8))
    for family, pattern in EXAMPLES.items():
        if pattern is None:
            continue  # dense attention never reaches the head groups
        try:
            name = dispatch.kernel(pattern, impl)
        except dispatch.Refused:
            with pytest.raises(ValueError):
                head_groups.multihead_sparse_attention(q, q, q, [pattern], impl=impl)
            continue
        calls = []
        for key, (module, attr) in CALLS.items():
            monkeypatch.setattr(
                module,
                attr,
                lambda *a, _key=key, _calls=calls, **kw: _calls.append((_key, kw)) or q,
            )
        head_groups.multihead_sparse_attention(q, q, q, [pattern], impl=impl)
        assert len(calls) == 1, (family, impl, calls)
        called, kw = calls[0]
        if name in ("routed", "routed_xla"):  # one function; the Triton kernel by keyword
            assert kw.get("kernel") == ("triton" if name == "routed" else None), (family, impl)
        else:
            assert called == name, (family, impl, called)
        monkeypatch.undo()
        monkeypatch.setattr(kernels, "platform_mode", lambda _: "xla")


def test_the_config_refuses_what_the_table_refuses():
    base = dict(vocab_size=24, d_model=32, num_heads=2, d_ff=32, max_len=32,
                attention_block_size=16, attention_dropout=0.0)  # fmt: skip
    specs = {"full": "full", "window": "local:window=8", "static": "bigbird",
             "routed": "moba:block=16,k=2", "topk": "topk:k=8", "dense": "dense"}  # fmt: skip
    for family, text in specs.items():
        for impl in dispatch.IMPLS:
            cell = dispatch.TABLE[family][dispatch.IMPLS.index(impl)]
            if cell in dispatch.KERNELS:
                ModelConfig(**base, attention_pattern=text, attention_impl=impl)
            else:
                with pytest.raises(ConfigError, match=f"attention_impl={impl}"):
                    ModelConfig(**base, attention_pattern=text, attention_impl=impl)
