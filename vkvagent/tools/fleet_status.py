"""``vkvagent fleet status``: the hosts of this host's ``[fleet]`` group, read from etcd."""

from __future__ import annotations

import argparse
import json
import time
from typing import TextIO

from vkvagent.adapters.fleet import Fleet, FleetError
from vkvagent.errors import VkvagentError
from vkvagent.knowledge import config
from vkvagent.knowledge.fleet_view import FleetView
from vkvagent.knowledge.status import StatusCode


def status(args: argparse.Namespace, out: TextIO) -> int:
    """The view, and its exit code; unknown (3) when there is none to give, as for
    `vkvagent status`, with the reason on stdout: a monitoring plugin's one line."""
    try:
        view = _view(config.load(args.config).fleet)
    except VkvagentError as exc:
        reason = "; ".join(str(exc).splitlines()) or type(exc).__name__
        if args.json:
            json.dump({"code": int(StatusCode.UNKNOWN), "error": reason}, out, indent=1)
            out.write("\n")
        else:
            out.write(f"fleet status unknown: {reason}\n")
        return StatusCode.UNKNOWN
    if args.json:
        json.dump(view.to_json(), out, indent=1)
        out.write("\n")
    else:
        out.write(view.render(time.time()))
    return view.code


def _view(settings: config.FleetConfig) -> FleetView:
    if not settings.endpoints:
        raise VkvagentError("no [fleet] endpoints in the config: this host is in no group")
    fleet = Fleet.from_config(settings)
    try:
        entries, holders = fleet.entries(), fleet.holders()
    except FleetError as exc:
        raise FleetError(f"group {fleet.group}: {exc}") from None
    return FleetView.of(fleet.group, fleet.max_concurrent, time.time(), entries, holders)
