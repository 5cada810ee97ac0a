#!/usr/bin/env bash
# Start specdec-serve (the OpenAI-compatible server; the [server] extra, pure Python). Configured by
# environment variables so the systemd unit can override them. Status: not run on a Jetson yet
# (docs/backends.md). Extra arguments are passed on (e.g. --num-draft-tokens auto).
set -euo pipefail

VENV=${SPECDEC_VENV:-$HOME/specdec-venv}
BUNDLE=${SPECDEC_BUNDLE:?set SPECDEC_BUNDLE to the bundle directory}
ARGS=(--bundle "$BUNDLE"
      --host "${SPECDEC_HOST:-127.0.0.1}"
      --port "${SPECDEC_PORT:-8000}"
      --provider "${SPECDEC_PROVIDER:-cuda}")
[ -n "${SPECDEC_DRAFT_PROVIDER:-}" ] && ARGS+=(--draft-provider "$SPECDEC_DRAFT_PROVIDER")
[ -n "${SPECDEC_MAX_LENGTH:-}" ] && ARGS+=(--max-context "$SPECDEC_MAX_LENGTH")
[ -n "${SPECDEC_THREADS:-}" ] && ARGS+=(--threads "$SPECDEC_THREADS")
[ -n "${SPECDEC_MAX_QUEUE:-}" ] && ARGS+=(--max-queue "$SPECDEC_MAX_QUEUE")
[ -n "${SPECDEC_DRAIN_TIMEOUT:-}" ] && ARGS+=(--drain-timeout "$SPECDEC_DRAIN_TIMEOUT")

exec "$VENV/bin/specdec-serve" "${ARGS[@]}" "$@"
