//! Chat conversations as datasets ship them, one JSON object a line, in either layout:
//!
//! ```text
//! {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}   ShareGPT
//! {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]} OpenAI
//! ```
//!
//! Both become a list of [`Message`]s with the roles a chat template expects (`system`, `user`,
//! `assistant`, `tool`). ShareGPT's speaker names are mapped (`human` -> user, `gpt` -> assistant,
//! ...). OpenAI content may also be a list of parts, of which the text parts are joined.

use serde::Serialize;
use serde_json::Value;

/// One turn: its role and text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An answer that stops before its end (`--regenerate` cut it at `--max-new-tokens`): the
    /// end-of-turn token the template writes after it is not the model's, so it is not
    /// supervised. Not shown to the template.
    #[serde(skip)]
    pub unfinished: bool,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.to_string(), content: content.to_string(), unfinished: false }
    }
}

/// Why a line is not a conversation (the caller adds the file and line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    #[error("not valid JSON at column {column} ({message})")]
    Json { column: usize, message: String },
    #[error(
        "neither `conversations` (ShareGPT: [{{\"from\", \"value\"}}]) nor `messages` (OpenAI: \
         [{{\"role\", \"content\"}}]) is a list in this object"
    )]
    NoConversation,
    #[error("turn {turn}: {what}")]
    Turn { turn: usize, what: String },
}

/// Parses one line (either layout).
pub fn parse_line(line: &str) -> Result<Vec<Message>, ChatError> {
    let v: Value =
        serde_json::from_str(line).map_err(|e| ChatError::Json { column: e.column(), message: e.to_string() })?;
    let (turns, role_key, text_key, sharegpt) = if let Some(Value::Array(t)) = v.get("conversations") {
        (t, "from", "value", true)
    } else if let Some(Value::Array(t)) = v.get("messages") {
        (t, "role", "content", false)
    } else {
        return Err(ChatError::NoConversation);
    };
    let mut out = Vec::with_capacity(turns.len());
    for (i, turn) in turns.iter().enumerate() {
        let err = |what: String| ChatError::Turn { turn: i + 1, what };
        // A ShareGPT line sometimes spells its keys the OpenAI way; accept either in both.
        let role = turn.get(role_key).or_else(|| turn.get(if sharegpt { "role" } else { "from" }));
        let role = match role {
            Some(Value::String(r)) => normalise_role(r)
                .ok_or_else(|| err(format!("unknown role {r:?}; use system, user (human), assistant (gpt) or tool")))?,
            Some(other) => return Err(err(format!("`{role_key}` must be a string, not {other}"))),
            None => return Err(err(format!("no `{role_key}` key"))),
        };
        let text = turn.get(text_key).or_else(|| turn.get(if sharegpt { "content" } else { "value" }));
        let content = match text {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) => String::new(),
            Some(Value::Array(parts)) => join_text_parts(parts).map_err(err)?,
            Some(other) => {
                return Err(err(format!("`{text_key}` must be a string or a list of text parts, not {other}")))
            }
            None => return Err(err(format!("no `{text_key}` key"))),
        };
        out.push(Message { role: role.to_string(), content, unfinished: false });
    }
    Ok(out)
}

/// The role a chat template expects for a dataset's speaker name.
fn normalise_role(r: &str) -> Option<&'static str> {
    Some(match r.to_ascii_lowercase().as_str() {
        "system" => "system",
        "user" | "human" => "user",
        "assistant" | "gpt" | "chatgpt" | "bing" | "bard" | "model" => "assistant",
        "tool" | "function" | "observation" => "tool",
        _ => return None,
    })
}

/// OpenAI content parts: `[{"type": "text", "text": "..."}, ...]`; non-text parts are refused
/// (the target here reads text only).
fn join_text_parts(parts: &[Value]) -> Result<String, String> {
    let mut s = String::new();
    for p in parts {
        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
            (Some("text") | None, Some(t)) => s.push_str(t),
            (Some(kind), _) => return Err(format!("a content part of type {kind:?}: only text parts are supported")),
            (None, None) => return Err("a content part without `text`".to_string()),
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_give_the_same_messages() {
        let a = parse_line(r#"{"conversations":[{"from":"system","value":"S"},{"from":"human","value":"Q"},{"from":"gpt","value":"A"}]}"#).unwrap();
        let b = parse_line(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q"},{"role":"assistant","content":[{"type":"text","text":"A"}]}]}"#).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, vec![Message::new("system", "S"), Message::new("user", "Q"), Message::new("assistant", "A")]);
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        assert!(matches!(parse_line("{"), Err(ChatError::Json { .. })));
        assert_eq!(parse_line(r#"{"text": "hi"}"#), Err(ChatError::NoConversation));
        let e =
            parse_line(r#"{"messages":[{"role":"user","content":"Q"},{"role":"robot","content":"A"}]}"#).unwrap_err();
        assert!(matches!(e, ChatError::Turn { turn: 2, .. }), "{e}");
        assert!(e.to_string().contains("robot"), "{e}");
        let e = parse_line(r#"{"messages":[{"role":"user"}]}"#).unwrap_err();
        assert!(e.to_string().contains("no `content`"), "{e}");
    }
}
