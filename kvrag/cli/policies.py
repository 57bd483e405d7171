"""``kvrag policies``: the registered reuse policies with their hyper-parameters."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser(
        "policies",
        help="list reuse policies and their hyper-parameters",
        description="The registered reuse policies: the default one, what each needs set up "
        "first, and their hyper-parameters (KVRag(policy=..., <param>=...)).",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvrag.policies import describe

    info = describe()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for pol in info:
        print(f"{pol['name']}{' (default)' if pol['default'] else ''}: {pol['summary']}")
        if pol["setup"]:
            print(f"    setup: {pol['setup']}")
        for prm in pol["params"]:
            print(f"    {prm['name']} = {prm['default']!r}  -- {prm['help']}")
    return 0
