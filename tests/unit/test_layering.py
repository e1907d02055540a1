"""The control plane's dependencies point one way.

`kvswap.control` decides in ids, counts and hashes: it imports the standard
library, itself, the shared vocabulary `kvswap.base` (tiers, transfers, block keys,
the policy door) and the leaf modules `kvswap.units` / `kvswap.errors` /
`kvswap.sampling` (a request's sampling, which the scheduler carries to the backend),
never torch, the data plane, the engine, the simulator, the monitoring or the
pydantic configuration (settings reach it as plain records from `kvswap.drive`).
`kvswap.base` stands below both planes: it imports only `kvswap.errors`, and the
data plane (`kvswap.data`) never imports the control plane. The check reads every
import statement of every module, so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvswap.control

CONTROL_DIR = Path(kvswap.control.__file__).parent
SRC = CONTROL_DIR.parent
LEAF_MODULES = ("kvswap.units", "kvswap.errors", "kvswap.sampling", "kvswap.import_path")
ALLOWED_KVSWAP = ("kvswap.control", "kvswap.base", *LEAF_MODULES)
FORBIDDEN_OTHERS = ("torch", "numpy", "pydantic")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
    return names


def test_control_imports_only_itself_and_leaf_modules() -> None:
    offenders = []
    for path in sorted(CONTROL_DIR.glob("*.py")):
        for name in imported_modules(path):
            root = name.split(".")[0]
            if root == "kvswap" and not name.startswith(ALLOWED_KVSWAP):
                offenders.append(f"{path.name}: {name}")
            if root in FORBIDDEN_OTHERS:
                offenders.append(f"{path.name}: {name}")
    assert offenders == []


def kvswap_imports(directory: Path) -> dict[str, set[str]]:
    """Every module under `directory` -> the kvswap modules it imports."""
    found = {}
    for path in sorted(directory.rglob("*.py")):
        names = imported_modules(path)
        found[str(path.relative_to(SRC))] = {n for n in names if n.split(".")[0] == "kvswap"}
    return found


def test_the_shared_vocabulary_imports_nothing_of_kvswap_but_itself_and_errors() -> None:
    for module, names in kvswap_imports(SRC / "base").items():
        assert {n for n in names if not n.startswith("kvswap.base")} <= {"kvswap.errors"}, module


def test_the_data_plane_never_imports_the_control_plane() -> None:
    for module, names in kvswap_imports(SRC / "data").items():
        assert not [n for n in names if n.startswith("kvswap.control")], module


def test_the_leaf_modules_import_nothing_of_kvswap_but_errors() -> None:
    src = CONTROL_DIR.parent
    for module in LEAF_MODULES:
        path = src / f"{module.removeprefix('kvswap.')}.py"
        kvswap_imports = {name for name in imported_modules(path) if name.split(".")[0] == "kvswap"}
        assert kvswap_imports <= {"kvswap.errors"}, (module, kvswap_imports)


def test_drive_and_simulator_run_without_torch() -> None:
    code = (
        "import sys, kvswap.control.swapper, kvswap.control.scheduler, kvswap.ledger, "
        "kvswap.config, kvswap.drive.loop, kvswap.drive.assembly, kvswap.drive.settings, "
        "kvswap.workload.arrivals, kvswap.sim.simulator;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_only_the_command_line_imports_the_commands() -> None:
    """The server, the engine and the simulator are built from settings records; no
    import runs back up to `kvswap.commands` (the server once took its model there)."""
    src = CONTROL_DIR.parent
    offenders = [
        f"{path.relative_to(src)}: {name}"
        for path in sorted(src.rglob("*.py"))
        if path.parent.name != "commands" and path.name not in ("cli.py", "__main__.py")
        for name in imported_modules(path)
        if name.startswith("kvswap.commands")
    ]
    assert offenders == []


def test_the_engine_and_its_server_thread_read_no_configuration_model() -> None:
    """`Engine` and the server's engine thread take a frozen `EngineSettings`; only
    `kvswap.engine.settings`, at the edge, reads the pydantic config."""
    src = CONTROL_DIR.parent
    for path in (
        src / "engine" / "engine.py",
        src / "engine" / "runner.py",
        src / "serve" / "engine_service.py",
    ):
        names = imported_modules(path)
        assert not {"kvswap.config", "kvswap.config_load", "argparse"} & names, path


def test_the_secondary_tier_interface_runs_without_torch() -> None:
    """A tier of one's own, and the adapter that makes it the engine's remote tier,
    need numpy and the control plane's vocabulary, never torch."""
    code = (
        "import sys, kvswap.data.tiers.base, kvswap.data.tiers.copy_adapter;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
