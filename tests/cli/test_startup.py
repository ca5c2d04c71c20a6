"""The command line starts without loading numpy or torch, so an early Ctrl-C is one line;
a plain plan loads only the parts of planning it uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# What the installed ``autopipe`` script runs, with an interrupt arriving while numpy loads.
INTERRUPTED_START = """
import sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
from autopipe.cli import main
sys.exit(main(["plan", "examples/mlp.py"]))
"""


def test_entry_point_loads_neither_numpy_nor_torch() -> None:
    code = (
        "import sys\n"
        "from autopipe.cli import main\n"
        "import autopipe\n"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_interrupt_while_the_libraries_load_is_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_START], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "autopipe: interrupted\n")


# A plain plan, then the modules it loaded of the parts of planning it does not use.
PLAIN_PLAN = """
import sys
from autopipe.cli import main
code = main(["plan", {model!r}, "--stages", "2", "--repeats", "1", "--warmup", "0"])
unused = ("autopipe.planning.configuration", "autopipe.planning.hardware")
print(code, sorted(name for name in sys.modules if name.startswith(unused)))
"""


def test_a_plain_plan_loads_neither_the_search_nor_the_catalog_nor_the_estimates() -> None:
    model = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_PLAN.format(model=model)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 []"
