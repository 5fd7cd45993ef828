"""``jaxtrain dashboard``: serves the live web dashboard over a storage path or one run until
interrupted. It only reads run directories; it never imports jax or starts workers."""

from __future__ import annotations

import argparse

from jaxtrain.cli.common import EXIT_OK, UsageError, say

DEFAULT_PORT = 8266


def cmd_dashboard(args: argparse.Namespace) -> int:
    from jaxtrain import dashboard

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: a port is 0 (any free one) to 65535")
    token = args.token
    if token is not None and not token:
        raise UsageError("--token '': the token must not be empty")
    if token is None and not dashboard.is_loopback(args.host):
        token = dashboard.new_token()
    try:
        source = dashboard.open_source(args.target)
        source.names()  # an unreadable storage path is said now, not on the first request
    except dashboard.SourceError as e:
        raise UsageError(str(e)) from None
    try:
        server = dashboard.Dashboard(source, args.host, args.port, token)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    print(f"jaxtrain dashboard: {server.url}", flush=True)
    say(f"serving the runs of {source.where} (read only); Ctrl-C stops")
    with server:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            return EXIT_OK
    return EXIT_OK


def add_parser(commands: argparse._SubParsersAction, formatter: type, exit_codes: str) -> None:
    dashboard = commands.add_parser(
        "dashboard", help="a live web dashboard of the runs under a storage path, or of one run",
        description="Serves a web page of the runs under STORAGE_PATH (default "
        "~/jaxtrain_results), or of the one run RUN, live: status, progress and ETA, attempts "
        "with their causes, ranks, metric curves, checkpoints (best marked) and log tails. It "
        "only reads the run directories. On a loopback address (the default) it needs no token; "
        "bound anywhere else, every request needs the token (--token, or one it makes and "
        "prints in the URL).",
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
                           help="the address to listen on (default 127.0.0.1; any other needs "
                           "a token)")
    dashboard.add_argument("--token", help="the token every request must carry (default: none "
                           "on a loopback address, else a new random one)")
    dashboard.set_defaults(handler=cmd_dashboard)
