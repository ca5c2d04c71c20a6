"""The planner core imports no torch, so planning is fast and runs anywhere."""

from __future__ import annotations

import subprocess
import sys


def test_planner_does_not_import_torch():
    code = (
        "import sys, autopipe\n"
        "from autopipe import partition, plan, Plan\n"
        "import autopipe.planning\n"
        "from autopipe.planning.split import exact, torchgpipe_split\n"
        "from autopipe.planning.model import cost_model\n"
        "from autopipe.planning.schedules import schedule_replay\n"
        "from autopipe.planning.split import interleaved_balance\n"
        "from autopipe.planning.configuration import config_search\n"
        "from autopipe.planning.schedules import simulation\n"
        "from autopipe.output import report\n"
        "from profiler import Profile\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
