//! The HTTP APIs agents speak, over any backend: OpenAI's `POST /v1/chat/completions`
//! (streaming and not, `n`, logprobs with `top_logprobs`, `stop`, `seed`, `max_tokens` /
//! `max_completion_tokens`, tools -> `tool_calls`) and `POST /v1/completions` (text or
//! token-id prompts, `echo`, logprobs); OpenAI's Responses API `POST /v1/responses`;
//! Anthropic's Messages API `POST /v1/messages`; and `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus text).
//!
//! Owns: HTTP, request validation, chat rendering (token-in-token-out: the model's own
//! template, then the tokenizer, nothing else), detokenization, stop strings and tool-call
//! parsing, and the episode tracker every chat-shaped API shares (an episode may mix
//! them). It reaches a model only through [`Backend`]: the server plugs in its engine,
//! the client plugs in the swarm. Never touches LibTorch.
//!
//! Extensions on every response (ignored by the SDKs, read by AgentJet's trainer):
//! `agentjet.prompt_token_ids`, `agentjet.policy_version`, and the completion's token ids
//! (`choices[i].token_ids`; `agentjet.token_ids` in Responses and Messages answers).
//!
//! Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}` (Anthropic's
//! `{"type": "error", "error": {"type", "message"}}` on `/v1/messages`): 400 for a bad
//! request (naming the field), 404 for an unknown model, 400 `context_length_exceeded`
//! (saying the limits), 413 for an oversize body, 429 when the engine's queue is full, 503
//! when not ready.

pub mod backend;
pub mod external;
pub mod http;
pub mod reward;
pub mod server;
pub mod text;
pub mod track;
pub mod types;

pub use backend::{Backend, ChoiceEvent, ChoiceStream, LocalBackend, Route, SignedPart};
