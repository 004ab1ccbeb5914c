"""The device mesh as the config writes it: ``train.mesh="data:-1,fsdp:2,model:1"``.

Parsed and checked here, below the model (the experiment config validates the spec
when it is built); :mod:`flaxformer_lite.model.partitioning` lays it over devices.
"""

from __future__ import annotations

import math

MESH_AXES = ("data", "fsdp", "model")
DEFAULT_MESH = "data:-1,fsdp:1,model:1"


class MeshError(ValueError):
    """A mesh that does not fit the devices or the model; the message names the fix."""


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data:-1,fsdp:2,model:1"`` -> ``{"data": -1, "fsdp": 2, "model": 1}``. Axes
    left out are 1, except ``data``, which takes the devices left over (``"fsdp:8"``
    is ``"data:-1,fsdp:8,model:1"``)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition(":")
        name = name.strip()
        if not sep or name not in MESH_AXES or name in seen:
            raise MeshError(
                f"train.mesh={spec!r}: {part!r} is not 'axis:size' with a new axis of "
                f"{', '.join(MESH_AXES)}; write e.g. {DEFAULT_MESH!r}"
            )
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1 and size != -1:
            raise MeshError(
                f"train.mesh={spec!r}: the size of {name!r} must be a positive integer or "
                "-1 (the devices left over)"
            )
        seen.add(name)
        sizes[name] = size
    if "data" not in seen and -1 not in sizes.values():
        sizes["data"] = -1
    if sum(v == -1 for v in sizes.values()) > 1:
        raise MeshError(f"train.mesh={spec!r}: only one axis may be -1")
    return sizes


def mesh_shape(spec: str, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, model) of ``spec`` over ``num_devices``, or a MeshError."""
    sizes = parse_mesh(spec)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if num_devices % fixed:
            raise MeshError(
                f"train.mesh={spec!r}: the fixed axes ({fixed} devices) do not divide the "
                f"{num_devices} devices; pick sizes whose product divides {num_devices}"
            )
        sizes = {k: (num_devices // fixed if v == -1 else v) for k, v in sizes.items()}
    elif fixed != num_devices:
        raise MeshError(
            f"train.mesh={spec!r} has {fixed} devices but {num_devices} are present; make "
            "the sizes multiply to the device count or set one axis to -1"
        )
    return tuple(sizes[a] for a in MESH_AXES)
