"""The ``autopipe profile`` command: measure the layers of a model file and save them."""

from __future__ import annotations

import argparse

from autopipe.cli.inputs import measure_model
from autopipe.cli.options import check_precision, check_writable, default_stages, save

__all__: list[str] = []  # internal to the command line


def profile_command(args: argparse.Namespace) -> int:
    """``autopipe profile``: measures every layer and writes the profile to ``--output``."""
    from autopipe.output import precision_label

    check_precision(args)
    check_writable(args.output, "profile")
    # Measured for the default stage count, as `autopipe plan` would plan it.
    profile, _ = measure_model(args, default_stages())
    save(profile, args.output, "profile")
    precision = precision_label({"dtype": profile.dtype, "autocast": profile.autocast})
    print(
        f"profiled {len(profile)} layers on {profile.device}"
        f"{f' ({precision})' if precision else ''} at micro-batch sizes "
        f"{profile.batch_sizes}; wrote {args.output}"
    )
    return 0
