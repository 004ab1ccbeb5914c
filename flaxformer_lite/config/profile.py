"""``train.profile``'s value, parsed (the rules check it; training's profiler reads it)."""

from __future__ import annotations

import re

from flaxformer_lite.config.fields import ConfigError


def profile_steps(spec: str) -> tuple[int, int] | None:
    """``train.profile`` as (first step, steps), None for ''; ConfigError otherwise."""
    if not spec:
        return None
    found = re.fullmatch(r"(\d+):(\d+)", spec.strip())
    if not found or int(found.group(1)) < 1 or int(found.group(2)) < 1:
        raise ConfigError(
            f"config.train.profile={spec!r}: write START:STEPS with positive integers, e.g. "
            "2:3 traces steps 2, 3 and 4 (step 1 compiles); '' for no trace"
        )
    return int(found.group(1)), int(found.group(2))
