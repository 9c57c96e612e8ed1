#!/bin/sh
# Example (d): an agent in plain shell with curl, no SDK. One chat call per episode.
# The client gives every episode OPENAI_BASE_URL (its local proxy), OPENAI_API_KEY (the
# episode's token) and AGENTJET_TASK (the task as JSON). Tasks look like
#   {"id": "add-3-4", "data": {"question": "What is 3 + 4?", "answer": "7", "model": "smollm2"}}
# The reward (last stdout line) is 1 when the reply contains the answer, else 0.
set -eu
field() { printf '%s' "$AGENTJET_TASK" | sed -n "s/.*\"$1\": *\"\([^\"]*\)\".*/\1/p"; }
question=$(field question)
answer=$(field answer)
model=$(field model)
[ -n "$model" ] || model=smollm2
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d "{\"model\": \"$model\", \"max_tokens\": ${AGENT_MAX_TOKENS:-32}, \"temperature\": 1.0,
       \"messages\": [{\"role\": \"user\", \"content\": \"$question Answer with the number only.\"}]}")
content=$(printf '%s' "$reply" | sed -n 's/.*"content": *"\(\([^"\\]\|\\.\)*\)".*/\1/p')
echo "question: $question"
echo "reply: $content"
case "$content" in
  *"$answer"*) echo '{"reward": 1.0}' ;;
  *) echo '{"reward": 0.0}' ;;
esac
