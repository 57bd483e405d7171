"""``kvrag policies``: the registered reuse policies with their hyper-parameters."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser(
        "policies",
        help="list reuse policies and their hyper-parameters",
        description="The registered reuse policies: which models each is the default of, what each needs set up "
        "first, and their hyper-parameters (KVRag(policy=..., <param>=...)).",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvrag.policies import describe
    from kvrag.policies.model_defaults import defaults_by_policy

    default_for = defaults_by_policy()
    info = [{**pol, "default_for": default_for.get(pol["name"], [])} for pol in describe()]
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print("policy='auto' (the default) runs each model's own default, chosen from its held-out benchmarks\n")
    for pol in info:
        default = f" (default for {'; '.join(pol['default_for'])})" if pol["default_for"] else ""
        print(f"{pol['name']}{default}: {pol['summary']}")
        if pol["setup"]:
            print(f"    setup: {pol['setup']}")
        for prm in pol["params"]:
            print(f"    {prm['name']} = {prm['default']!r}  -- {prm['help']}")
    return 0
