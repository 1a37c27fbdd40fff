"""The `cadence bench`, `cadence logs` and `cadence replicas` commands, registered with the
`cadence` CLI as entry points (pyproject.toml, group "cadence.commands"): the product finds
its tooling by name and never imports it."""

from __future__ import annotations

import sys


def bench(argv: list[str] | None = None) -> int:  # noqa: PLR0915  (one branch a bench)
    """`cadence bench SCENARIO | compare | capacity | chat | prefix | structured | engine |
    sampler | processors | roofline | attention | kv-accuracy | weight-accuracy |
    speculation | tensor-parallel | plan | quant | hybrid | pd | pd-interference | lora`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", argv)
    if command == "compare":
        from ops.compare import main
    elif command == "engine":
        from ops.engine_bench import main
    elif command == "sampler":
        from ops.sampler_bench import main
    elif command == "processors":
        from ops.processors_bench import main
    elif command == "roofline":
        from ops.roofline import main
    elif command == "attention":
        from ops.attention_bench import main
    elif command == "kv-accuracy":
        from ops.kv_accuracy import main
    elif command == "weight-accuracy":
        from ops.weight_accuracy import main
    elif command == "capacity":
        from ops.capacity import main
    elif command == "prefix":
        from ops.prefix_probe import main
    elif command == "chat":
        from ops.chat import main
    elif command == "structured":
        from ops.structured_bench import main
    elif command == "speculation":
        from ops.spec_bench import main
    elif command == "tensor-parallel":
        from ops.tp_bench import main
    elif command == "plan":
        from ops.plan_bench import main
    elif command == "quant":
        from ops.quant_bench import main
    elif command == "hybrid":
        from ops.hybrid_bench import main
    elif command == "pd":
        from ops.pd_bench import main
    elif command == "pd-interference":
        from ops.pd_interference import main
    elif command == "lora":
        from ops.lora_bench import main
    else:
        from ops.bench import main

        rest = argv
    return main(rest)


def logs(argv: list[str] | None = None) -> int:
    """`cadence logs report LOGFILE ...` or `cadence logs story LOGFILE... REQUEST_ID`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["story"]:
        from ops.request_story import main

        return main(argv[1:])
    from ops.logs_report import main

    return main(argv)


def replicas(argv: list[str] | None = None) -> int:
    """`cadence replicas [-n N] ... [-- SERVE FLAGS]`: N servers behind sglang-router."""
    from ops.replicas import main

    return main(argv)
