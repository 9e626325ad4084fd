"""``python -m dpcourse doctor``: what this machine has, which profile the lessons will use,
and what to fix when something is missing. Lesson 00 runs it.

    python -m dpcourse doctor          # the report
    python -m dpcourse doctor --json   # the same, for scripts
    python -m dpcourse doctor --run    # every lesson and solution here (dpcourse.tools.doctor_run)
    python -m dpcourse diagnose [--nproc 2] [--timeout 10] [--detail] script.py [script args]
    python -m dpcourse workshop-check --learners 4 [--json]   # rehearse 4 learners at once
    python -m dpcourse workshop-check --plan --gpus 8 --cores 64 --learners 20 \
        [--format exports|jupyterhub|json]   # the seats (dpcourse.tools.workshop)
    python -m dpcourse build [NN ...]  # execute sources into notebooks, generate the labs
    python -m dpcourse check           # notebooks and labs in sync with their sources?
    python -m dpcourse times           # each lesson's honest time against its header
    python -m dpcourse mutate [labNN]  # how good are the lab checks? (dpcourse.tools.mutate)
    python -m dpcourse progress PATH   # the class table from DPCOURSE_PROGRESS (tools.progress)
    python -m dpcourse translate status|update NAME|build   # the Chinese edition (tools.translate)

``build``, ``check`` and ``times`` are :mod:`dpcourse.tools.authoring`'s commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def diagnose(report) -> list[str]:
    """Advice for what is missing or mismatched; empty when all is well."""
    advice = []
    if sys.version_info < (3, 10):
        advice.append("Python 3.10 or newer is needed (3.11 is what the course is tested on).")
    if not report.gloo:
        advice.append("torch.distributed with gloo is missing: install the official torch wheel "
                      "(pip install -r requirements.txt); lessons 03, 04 and 06 need it.")
    if report.gpus and not report.nccl:
        advice.append("GPUs are visible but NCCL is not: multi-GPU lessons will fall back to "
                      "gloo. Install a CUDA build of torch (see README, GPU workstation).")
    if report.torch_cuda_build and not report.gpus:
        advice.append("note: this torch is a CUDA build but sees no GPU; that is fine, the "
                      "lessons use the cpu profile (check CUDA_VISIBLE_DEVICES if you expected one).")
    tf = report.packages.get("tensorflow") or report.packages.get("tensorflow-cpu")
    if tf is None:
        advice.append("TensorFlow is missing: lesson 05 needs it (tensorflow-cpu, or "
                      "tensorflow[and-cuda] on a GPU machine).")
    for name in ("nbval", "jupytext", "ipywidgets", "matplotlib"):
        if report.packages.get(name) is None:
            advice.append(f"{name} is missing: pip install -r requirements.txt")
    return advice


def doctor(as_json: bool = False) -> int:
    from dpcourse import devices

    report = devices.hardware_report()
    try:
        profile = devices.choose_profile(report)
        profile_error = None
    except ValueError as exc:
        profile, profile_error = None, str(exc)
    advice = diagnose(report)
    # versions below the course's floors, each with its pip command (dpcourse.versions; the
    # notebooks' first cell runs the same check)
    from dpcourse.versions import version_problems

    advice += version_problems(notebook=False)
    if profile_error:
        advice.insert(0, profile_error)
    if as_json:
        print(json.dumps({"report": asdict(report), "profile": asdict(profile) if profile else None,
                          "advice": advice}, indent=1))
        return 0 if profile else 1
    tf = report.packages.get("tensorflow") or report.packages.get("tensorflow-cpu")
    print("dpcourse doctor")
    print(f"  python       {report.python} on {report.platform}, {report.cpu_count} CPU(s)")
    print(f"  torch        {report.torch} (CUDA build: {report.torch_cuda_build or 'no'})")
    print(f"  tensorflow   {tf or 'not installed'}")
    print(f"  GPUs         {report.gpu_count}" + "".join(f"\n    cuda:{i} {n}" for i, n in
                                                       enumerate(report.gpus)))
    nccl = ("yes" if report.nccl else "built, no GPU to use it" if report.nccl_built
            else "not built")
    print(f"  backends     gloo {'yes' if report.gloo else 'NO'}, nccl {nccl}")
    if profile:
        print(f"  {profile.describe()}")
        print("  lessons      01 on {0}; 02 {1}; 03-04 and 06 with {2} ranks over {3}; 05 over "
              "{4} {5} device(s)".format(
                  profile.device,
                  "real nn.DataParallel" if profile.name == "multi-gpu"
                  else "DataParallel from scratch (real DP needs 2+ GPUs)",
                  profile.world_size, profile.backend, profile.tf_devices,
                  profile.tf_device_type))
    print("  advice       " + ("none: everything the course needs is here" if not advice
                             else "\n    - ".join([""] + advice)))
    return 0 if profile else 1


def diagnose_script(script: str, script_args: list[str], nproc: int = 2, timeout: float = 10.0,
                    detail: bool = False, cpu: bool = False, as_json: bool = False) -> int:
    """``python -m dpcourse diagnose [options] script.py [args]`` (options before the script):
    run a torchrun-style script on ``nproc`` local ranks (gloo) for at most ``timeout`` s and
    print what went wrong: finished, hung (which ranks, in which collective, at which line) or
    failed (which rank, why, and for the common mistakes what to change), the first collective
    where the ranks disagree, and the run-time checks' findings (dpcourse.script_checks), each
    with the script's file:line, the fix and the lesson. On one of lab 10's own scripts (its
    docstring starts "Lab 10, bug N") the findings are withheld: the lab's check judges those.
    Exit code 0 only for a clean, consistent run with nothing found; 2 for input that is not a
    script to run.

    Shown in lesson 10, §5.
    """
    import os
    import re
    from pathlib import Path

    from dpcourse import detectors

    path = Path(script)
    if not path.is_file():
        print(f"diagnose: {script} is not a file: give the path of a Python training script")
        return 2
    try:
        compile(path.read_text(encoding="utf-8", errors="replace"), str(path), "exec")
    except SyntaxError as err:
        print(f"diagnose: {script} is not valid Python (line {err.lineno}: {err.msg}): fix "
              f"that first")
        return 2
    if nproc < 1 or timeout <= 0:
        print("diagnose: --nproc must be at least 1 and --timeout a positive number of seconds")
        return 2

    fixed_port = os.environ.get("MASTER_PORT")
    if fixed_port and fixed_port.isdigit():
        owner = detectors.port_owner(int(fixed_port))
        if owner is not None:
            print(f"port {fixed_port} (MASTER_PORT) is already in use"
                  + (f" by pid {owner['pid']} ({owner['name']})" if owner["pid"] else "")
                  + ": unset MASTER_PORT (diagnose picks a free one) or stop that process")
            return 2
        os.environ.pop("MASTER_PORT")
    result = detectors.diagnose(script, nproc, *script_args, timeout=timeout,
                                debug_detail=detail, cpu=cpu)
    if result.status == "failed" and "SystemExit: 2" in (result.error or ""):
        result.error += (" — the script's argument parser refused its arguments: pass them "
                         "after the script's name (diagnose script.py --epochs 1)")
    ok = result.ok
    lab = re.match(r'\s*"""(Lab \d+, bug \d+):', path.read_text(encoding="utf-8",
                                                                 errors="replace"))
    if lab:   # a lab's own script: its check is the teacher, so no finding names bug or fix
        result.findings, result.events = [], {}
    if as_json:
        from dpcourse import script_checks

        print(json.dumps({"script": script, "ranks": nproc, "status": result.status,
                          "error": result.error, "error_where": result.error_where,
                          "pending": result.pending,
                          "collectives_agree": result.trace.ok,
                          "explained": script_checks.explain_failure(result.error or ""),
                          "findings": script_checks.as_dicts(result.findings),
                          "findings_withheld": bool(lab), "ok": ok}, indent=1))
        return 0 if ok else 1
    print(f"dpcourse diagnose {script} on {nproc} ranks" + (" (--cpu: NCCL as gloo, CUDA calls "
          "kept on the CPU; this cannot tell whether the script runs on GPUs)" if cpu else ""))
    print(result.report())
    if lab:
        print(f"run-time checks: withheld ({lab.group(1)}: the lab's check judges this "
              f"script)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["workshop-check"]:  # its own parser, in dpcourse.tools.workshop
        from dpcourse.tools import workshop

        return workshop.main(argv[1:])
    if argv[:1] in (["build"], ["check"], ["times"]):  # the course build's own parser
        from dpcourse.tools import authoring

        return authoring.main(argv, prog="python -m dpcourse")
    if argv[:1] == ["mutate"]:  # its own parser, in dpcourse.tools.mutate
        from dpcourse.tools import mutate

        return mutate.main(argv[1:])
    if argv[:1] == ["progress"]:  # its own parser, in dpcourse.tools.progress
        from dpcourse.tools import progress

        return progress.main(argv[1:])
    if argv[:1] == ["translate"]:  # its own parser, in dpcourse.tools.translate
        from dpcourse.tools import translate

        return translate.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m dpcourse")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="check this machine for the course")
    d.add_argument("--json", action="store_true")
    d.add_argument("--run", action="store_true", help="execute every lesson and lab solution "
                   "under strict nbval on this machine's profile and report per notebook")
    d.add_argument("--only", action="append", metavar="TEXT",
                   help="with --run: only notebooks whose name contains TEXT (repeatable)")
    d.add_argument("--profile", choices=("cpu", "one-gpu", "multi-gpu"),
                   help="with --run: force a profile (as DPCOURSE_PROFILE does)")
    d.add_argument("--timeout", type=float, default=900.0,
                   help="with --run: seconds per notebook (default 900)")
    d.add_argument("--list", action="store_true", help="with --run: list what would run")
    g = sub.add_parser("diagnose", help="run a torchrun-style script on N local ranks, bounded, "
                       "and report hangs, failures and mismatched collectives")
    g.add_argument("script")
    g.add_argument("script_args", nargs=argparse.REMAINDER)
    g.add_argument("--nproc", type=int, default=2)
    g.add_argument("--timeout", type=float, default=10.0)
    g.add_argument("--detail", action="store_true", help="TORCH_DISTRIBUTED_DEBUG=DETAIL")
    g.add_argument("--cpu", action="store_true", help="a GPU-only script on the CPU: NCCL as "
                   "gloo, .cuda()/.to('cuda') kept on the CPU, DDP without device_ids")
    g.add_argument("--json", action="store_true", help="the report as JSON, for tools")
    sub.add_parser("workshop-check", add_help=False,
                   help="rehearse N learners launching at once: ports, orphans, times, and "
                   "the per-learner settings (--learners N, --plan, --json)")
    sub.add_parser("build", add_help=False, help="execute lesson and solution sources into "
                   "their notebooks and generate the labs (build [NN ...])")
    sub.add_parser("check", add_help=False, help="list notebooks and labs out of sync with "
                   "their sources (executes nothing)")
    sub.add_parser("times", add_help=False, help="each lesson's honest time against its header")
    sub.add_parser("mutate", add_help=False, help="break each lab solution one line at a time "
                   "and list the broken answers its check lets through (mutate [labNN ...])")
    sub.add_parser("progress", add_help=False, help="the class table from the file the lab "
                   "checks append to (DPCOURSE_PROGRESS): who passed which check, and the most "
                   "common mistake (progress PATH [--lab labNN] [--json])")
    sub.add_parser("translate", add_help=False, help="the Chinese edition: which translations "
                   "are missing or stale (status), add blocks for new English cells (update "
                   "NAME), write zh/ (build)")
    args = parser.parse_args(argv)
    if args.cmd == "diagnose":
        return diagnose_script(args.script, args.script_args, args.nproc, args.timeout,
                               args.detail, args.cpu, args.json)
    if args.cmd == "doctor" and not args.run and (args.only or args.profile or args.list):
        parser.error("--only, --profile and --list go with --run")
    if args.cmd == "doctor" and args.run:
        if args.timeout <= 0:
            parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        from dpcourse.tools import doctor_run

        return doctor_run.main(args.only, args.profile, args.timeout, args.json, args.list)
    return doctor(args.json)


if __name__ == "__main__":
    sys.exit(main())
