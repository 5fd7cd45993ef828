"""``jaxtrain dashboard``: serves the live web dashboard over a storage path or one run until
interrupted. It only reads run directories; it never imports jax or starts workers."""

from __future__ import annotations

import argparse
import os
import stat

from jaxtrain.cli.common import EXIT_OK, UsageError, say

DEFAULT_PORT = 8266
TOKEN_ENV = "JAXTRAIN_DASHBOARD_TOKEN"


def _token(args: argparse.Namespace) -> str:
    """The token every request must carry: --token-file's, JAXTRAIN_DASHBOARD_TOKEN's, or a new
    random one. Never from the command line, which every local user can read (ps)."""
    if args.token is not None:
        raise UsageError(
            "--token is not accepted: a command line is visible to every user of this host "
            f"(ps, /proc); put the token in a file only you can read and give --token-file FILE, "
            f"or set {TOKEN_ENV}, or give neither to have a new one made and printed")
    if args.token_file is not None:
        try:
            fd = os.open(args.token_file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise UsageError(f"--token-file {args.token_file}: {e.strerror}") from None
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read(4096).strip()
        if mode & 0o077:
            raise UsageError(f"--token-file {args.token_file}: other users may read it (mode "
                             f"{stat.filemode(mode)}); chmod 600 it")
        if not token:
            raise UsageError(f"--token-file {args.token_file}: the file is empty; write the "
                             "token in it")
        return token
    token = os.environ.get(TOKEN_ENV)
    if token is not None:
        if not token.strip():
            raise UsageError(f"{TOKEN_ENV} is empty; unset it to have a token made, or set it "
                             "to the token")
        return token.strip()
    from jaxtrain import dashboard

    return dashboard.new_token()


def cmd_dashboard(args: argparse.Namespace) -> int:
    from jaxtrain import dashboard

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: a port is 0 (any free one) to 65535")
    token = _token(args)
    try:
        source = dashboard.open_source(args.target)
        # An unreadable storage path is said now, not on the first request.
        no_runs = not source.names()
    except dashboard.SourceError as e:
        raise UsageError(str(e)) from None
    try:
        server = dashboard.Dashboard(source, args.host, args.port, token)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    print(f"jaxtrain dashboard: {server.url}", flush=True)
    say(f"serving the runs of {source.where} (read only); Ctrl-C stops")
    if no_runs:
        say("no runs there yet: the page lists them as they appear")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        server.stop()
    return EXIT_OK


def add_parser(commands: argparse._SubParsersAction, formatter: type, exit_codes: str) -> None:
    dashboard = commands.add_parser(
        "dashboard", help="a live web dashboard of the runs under a storage path, or of one run",
        description="Serves a web page of the runs under STORAGE_PATH (default "
        "~/jaxtrain_results), or of the one run RUN, live: status, progress and ETA, attempts "
        "with their causes, ranks, metric curves, checkpoints (best marked) and log tails. It "
        "only reads the run directories. Every request needs the token, on a loopback address "
        "(the default) too: other users of this host can connect there. The token is read from "
        f"--token-file or {TOKEN_ENV}, or else made anew and printed in the URL.",
        epilog=f"example:\n  jaxtrain dashboard /mnt/nfs/runs --port {DEFAULT_PORT}\n"
        "  jaxtrain dashboard s3://bucket/runs --host 0.0.0.0\n\n" + exit_codes,
        formatter_class=formatter,
    )
    dashboard.add_argument("target", nargs="?", metavar="STORAGE_PATH|RUN",
                           help="a storage path (local or a URL), a run directory, or a run's "
                           "name under the default storage path")
    dashboard.add_argument("--port", type=int, default=DEFAULT_PORT,
                           help=f"the port to listen on (default {DEFAULT_PORT}; 0: any free one)")
    dashboard.add_argument("--host", default="127.0.0.1",
                           help="the address to listen on (default 127.0.0.1)")
    dashboard.add_argument("--token-file", metavar="FILE",
                           help="a file (readable by you alone) holding the token every request "
                           f"must carry (default: {TOKEN_ENV}, else a new random one, printed "
                           "in the URL)")
    dashboard.add_argument("--token", help=argparse.SUPPRESS)  # refused: argv is public
    dashboard.set_defaults(handler=cmd_dashboard)
