#!/usr/bin/env bash
# Point a real coding agent at a running `talaria serve`, with no change on the agent's side.
#
#   examples/coding_agents/run_client.sh claude|codex|opencode [MODEL] [PROMPT] [CLIENT ARGS...]
#
# Needs the client installed (npm install -g @anthropic-ai/claude-code @openai/codex
# opencode-ai; node 20) and a server (`talaria serve --port 8000`; a model whose context
# holds the client's first prompt: Claude Code's is about 20K tokens, so for a protocol
# check serve `agent-tiny-dummy`, a random-weight model with a 32K context, whose answers
# are noise). TALARIA_URL (default http://127.0.0.1:8000) and TALARIA_API_KEY (any text
# when the server has no keys) say where. Each client runs in a scratch directory, with its
# telemetry off and its configuration in a scratch home, so nothing of yours is touched
# (TALARIA_CLIENT_DIR names the directory to work in instead; the home is made inside it).
# Arguments after the prompt go to the client (e.g. claude's --session-id UUID).
# Claude Code asks for 32,000 output tokens whatever the model; the server answers with what
# the context leaves, and CLAUDE_CODE_MAX_OUTPUT_TOKENS (512 here unless set) caps it.
set -euo pipefail
client=${1:?say which client: claude, codex or opencode}
model=${2:-agent-tiny-dummy}
prompt=${3:-Say hello}
shift $(($# < 3 ? $# : 3))
url=${TALARIA_URL:-http://127.0.0.1:8000}
key=${TALARIA_API_KEY:-none}
here=$(cd "$(dirname "$0")" && pwd)
scratch=${TALARIA_CLIENT_DIR:-$(mktemp -d)}
cd "$scratch"
case "$client" in
claude)
    # Anthropic Messages API (POST /v1/messages); the session is X-Claude-Code-Session-Id.
    HOME="$scratch" ANTHROPIC_BASE_URL="$url" ANTHROPIC_API_KEY="$key" \
        ANTHROPIC_DEFAULT_HAIKU_MODEL="$model" \
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="${CLAUDE_CODE_MAX_OUTPUT_TOKENS:-512}" \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 \
        claude -p "$prompt" --model "$model" "$@"
    ;;
codex)
    # OpenAI Responses API (POST /v1/responses); the session is Codex's session-id header.
    mkdir -p "$scratch/codex"
    sed -e "s|@URL@|$url/v1|" -e "s|@MODEL@|$model|" "$here/codex.toml" > "$scratch/codex/config.toml"
    CODEX_HOME="$scratch/codex" TALARIA_API_KEY="$key" codex exec --skip-git-repo-check "$@" "$prompt"
    ;;
opencode)
    # Chat completions (POST /v1/chat/completions); the session is its x-session-id header.
    sed -e "s|@URL@|$url/v1|" -e "s|@MODEL@|$model|" "$here/opencode.json" > opencode.json
    HOME="$scratch" OPENCODE_DISABLE_AUTOUPDATE=1 TALARIA_API_KEY="$key" opencode run "$@" "$prompt"
    ;;
*)
    echo "unknown client $client: say claude, codex or opencode" >&2
    exit 2
    ;;
esac
