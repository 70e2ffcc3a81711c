//! The target's chat template: the Jinja source from `chat_template.jinja` or
//! `tokenizer_config.json`'s `chat_template`, rendered with minijinja the way `transformers`'
//! `apply_chat_template` renders it: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`strip`, `startswith`, `split`, ...) through minijinja-contrib's pycompat, `raise_exception`
//! and `strftime_now` defined, the special tokens (`bos_token`, `eos_token`, ...) as variables.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

use super::chat::Message;
use super::PrepareError;

const TEMPLATE_NAME: &str = "chat";

/// A loaded chat template with the special-token strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` from `tokenizer_config.json`.
    specials: Vec<(&'static str, String)>,
    /// Where the template came from (for messages).
    pub source: PathBuf,
}

impl ChatTemplate {
    /// Loads the template of the checkpoint folder `dir`: `chat_template.jinja` if present (newer
    /// `transformers` write it there), else `tokenizer_config.json`'s `chat_template` (a string, or
    /// a list of `{name, template}` of which `default` is used).
    pub fn from_dir(dir: &Path) -> Result<Self, PrepareError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<Json> = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => Some(serde_json::from_str(&text).map_err(|e| PrepareError::TargetFile {
                path: cfg_path.clone(),
                what: format!("not valid JSON: {e}"),
            })?),
            Err(_) => None,
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, text) = if let Ok(t) = std::fs::read_to_string(&jinja) {
            (jinja, t)
        } else {
            let t = cfg.as_ref().and_then(|c| c.get("chat_template")).and_then(template_from_config);
            match t {
                Some(t) => (cfg_path.clone(), t),
                None => return Err(PrepareError::NoTemplate { dir: dir.to_path_buf() }),
            }
        };
        let mut specials = Vec::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(s) = cfg.as_ref().and_then(|c| c.get(key)).and_then(token_string) {
                specials.push((key, s));
            }
        }
        Self::new(&text, specials, source)
    }

    /// A template from its source text (tests, and [`ChatTemplate::from_dir`]).
    pub fn new(text: &str, specials: Vec<(&'static str, String)>, source: PathBuf) -> Result<Self, PrepareError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| PrepareError::Template { file: source.clone(), what: e.to_string() })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_template_owned(TEMPLATE_NAME, text.to_string())
            .map_err(|e| PrepareError::Template { file: source.clone(), what: format!("{e:#}") })?;
        Ok(ChatTemplate { env, specials, source })
    }

    /// The special-token string `key` (`eos_token`, ...), if the tokenizer config names one.
    pub fn special(&self, key: &str) -> Option<&str> {
        self.specials.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// answer would begin. An error is the template's own complaint (e.g. `raise_exception`).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| e.to_string())?;
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                let map: BTreeMap<String, Value> = [("role", &m.role), ("content", &m.content)]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), Value::from(v.as_str())))
                    .collect();
                Value::from_object(map)
            })
            .collect();
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        for (k, v) in &self.specials {
            ctx.insert(k.to_string(), Value::from(v.as_str()));
        }
        let ctx = Value::from_object(ctx);
        tmpl.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => e.detail().unwrap_or("the template raised an exception").to_string(),
            _ => format!("{e:#}"),
        })
    }
}

/// `chat_template` in a tokenizer config: a string, or `[{"name": "default", "template": ...}]`.
fn template_from_config(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list
            .iter()
            .find(|e| e.get("name").and_then(Json::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|e| e.get("template"))
            .and_then(Json::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// A special token in a tokenizer config: a string or an `AddedToken` object with `content`.
pub fn token_string(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// `strftime_now(fmt)` as `transformers` defines it for templates that print today's date (UTC
/// here): `%d %m %Y %y %b %B %H %M %S %%` are supported, other directives pass through.
fn strftime_now(fmt: &str) -> Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let (hh, mm, ss) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    #[test]
    fn python_methods_trim_blocks_and_raise_exception() {
        let src = "{% for m in messages %}\n{% if m.role == 'user' and m.content.startswith('x') %}\n{{ raise_exception('no x') }}\n{% endif %}\n[{{ m.content.strip() }}]{{ eos_token }}\n{% endfor %}";
        let t = ChatTemplate::new(src, vec![("eos_token", "<e>".into())], PathBuf::from("t")).unwrap();
        assert_eq!(t.render(&[Message::new("user", "  hi ")], false).unwrap(), "[hi]<e>\n");
        assert_eq!(t.render(&[Message::new("user", "xy")], false).unwrap_err(), "no x");
    }

    /// The constructs Qwen3-style templates use: a namespace set in a reversed loop, `is string`,
    /// `split(...)[-1].lstrip(...)`, `loop.last`, and a thinking block only on the final answer.
    #[test]
    fn qwen3_style_constructs() {
        let src = r#"{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}
{%- if ns.last_user == -1 and m.role == 'user' %}{%- set ns.last_user = (messages|length - 1) - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.content is string %}
{%- set content = m.content.split('</think>')[-1].lstrip('
') %}
{%- if loop.index0 > ns.last_user and loop.last %}
{{- '<s>assistant
<think>

</think>

' + content + '<e>
' }}
{%- else %}
{{- '<s>assistant
' + content + '<e>
' }}
{%- endif %}
{%- else %}
{{- '<s>' + m.role + '
' + m.content + '<e>
' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<s>assistant
' }}{%- endif %}"#;
        let t = ChatTemplate::new(src, vec![], PathBuf::from("t")).unwrap();
        let msgs = [
            Message::new("user", "a"),
            Message::new(
                "assistant",
                "<think>x</think>

b",
            ),
            Message::new("user", "c"),
            Message::new("assistant", "d"),
        ];
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            "<s>user\na<e>\n<s>assistant\nb<e>\n<s>user\nc<e>\n<s>assistant\n<think>\n\n</think>\n\nd<e>\n"
        );
        assert_eq!(
            t.render(&msgs[..3], true).unwrap(),
            "<s>user\na<e>\n<s>assistant\nb<e>\n<s>user\nc<e>\n<s>assistant\n"
        );
    }
}
