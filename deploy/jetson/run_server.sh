#!/usr/bin/env bash
# Start the specdec-rt HTTP server (stdlib only). Configured by environment variables so the
# systemd unit can override them. Status: not run on a Jetson yet (docs/backends.md).
set -euo pipefail

VENV=${SPECDEC_VENV:-$HOME/specdec-venv}
BUNDLE=${SPECDEC_BUNDLE:?set SPECDEC_BUNDLE to the bundle directory}
ARGS=(--bundle "$BUNDLE"
      --host "${SPECDEC_HOST:-127.0.0.1}"
      --port "${SPECDEC_PORT:-8000}"
      --provider "${SPECDEC_PROVIDER:-cuda}")
[ -n "${SPECDEC_DRAFT_PROVIDER:-}" ] && ARGS+=(--draft-provider "$SPECDEC_DRAFT_PROVIDER")
[ -n "${SPECDEC_MAX_LENGTH:-}" ] && ARGS+=(--max-length "$SPECDEC_MAX_LENGTH")
[ -n "${SPECDEC_THREADS:-}" ] && ARGS+=(--threads "$SPECDEC_THREADS")

exec "$VENV/bin/python" -m specdec_rt.server "${ARGS[@]}" "$@"
