"""The device check's report: where each section's process leaves its result, and the
report files (report.json, report.md) the runner (ops.device_check) writes after every
section. Standard library only: the runner imports no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository


def result_path(out: Path, name: str) -> Path:
    """Where section `name`'s process writes its result (JSON)."""
    return out / "sections" / f"{name}.json"


def write_report(out: Path, report: dict[str, Any]) -> None:
    records = report["sections"].values()
    report["passed"] = all(record["ok"] for record in records)
    report["budget_s"] = sum(record["timeout_s"] for record in records)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    """The report as text: a summary line per section, then each section's tables (a
    list of records as one table, a record as a table of one row)."""
    lines = ["# Device check", "", _headline(report), ""]
    summary = [
        {"section": name, "status": record["status"], "seconds": record.get("seconds", "")}
        | {"timeout_s": record["timeout_s"], "note": record.get("note", "")}
        for name, record in report["sections"].items()
    ]
    lines += _table(summary)
    for name, record in report["sections"].items():
        lines += ["", f"## {name}", "", f"{record['status']}", ""]
        lines += _result_lines(record.get("result") or {})
        if record.get("tail"):
            lines += ["", "Output, last lines:", "", "```", record["tail"], "```"]
    return "\n".join(lines) + "\n"


def _headline(report: dict[str, Any]) -> str:
    line = f"device: {report['device']}; passed: {report['passed']}"
    if "seconds" in report:
        line += f"; {report['seconds']} s"
    if "deadline_s" in report:
        line += f" (deadline {report['deadline_s']:g} s)"
    return line


def _result_lines(result: dict[str, Any]) -> list[str]:
    scalars = {k: v for k, v in result.items() if k != "error" and not _is_rows(v)}
    scalars = {k: v for k, v in scalars.items() if not isinstance(v, dict)}
    lines = _table([scalars]) if scalars else []
    for key, value in result.items():
        if _is_rows(value):
            lines += ["", f"{key}:", "", *_table(value)]
        elif isinstance(value, dict) and value:
            lines += ["", f"{key}:", "", *_table([value])]
    if result.get("error"):
        lines += ["", "```", str(result["error"]).rstrip(), "```"]
    return lines


def _is_rows(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def say(text: str) -> None:
    print(text, flush=True)
