"""JUnit XML for CI systems: one test case per threshold, the report table as the suite's output.

Jenkins, GitLab and GitHub test reporters read this schema (testsuites > testsuite >
testcase, a <failure> child for a failed case), so a failed quality gate shows up
next to the project's unit tests with its one-line verdict as the message.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from qtool import atomic
from qtool.evaluation.report import EvaluationReport, render_table


def junit_xml(report: EvaluationReport) -> str:
    verdicts = report.thresholds
    failures = sum(not v.passed for v in verdicts)
    int8_name = Path(report.models["int8"]["path"]).name
    counts = {"tests": str(len(verdicts)), "failures": str(failures), "errors": "0", "skipped": "0"}
    root = ET.Element("testsuites", name="qtool evaluate", **counts)
    suite = ET.SubElement(root, "testsuite", name=f"qtool evaluate {int8_name}", **counts)
    for verdict in verdicts:
        # classname: CI viewers split it at dots into a package tree, so no file name in it
        case = ET.SubElement(suite, "testcase", classname="qtool.thresholds", name=verdict.name, time="0")
        if not verdict.passed:
            failure = ET.SubElement(case, "failure", message=verdict.message, type="threshold")
            failure.text = verdict.message
        else:
            ET.SubElement(case, "system-out").text = verdict.message
    ET.SubElement(suite, "system-out").text = render_table(report)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(report: EvaluationReport, path: str | Path) -> None:
    atomic.write_text(path, junit_xml(report))
