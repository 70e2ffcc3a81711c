//! A conversation to `input_ids` + `loss_mask`: the chat template renders it, the target's
//! `tokenizer.json` tokenizes the text (with byte offsets), and the mask is 1 exactly on the
//! tokens of each assistant turn, from the first token of the answer through the end-of-turn
//! token the template puts after it (as the PyTorch DFlash/EAGLE trainers mask), 0 elsewhere.
//!
//! Where each answer lies in the rendered text is found by the template itself: rendering the
//! messages before assistant turn `k` with `add_generation_prompt` gives a prefix of the whole
//! conversation's text that ends where the answer begins; the answer ends with the first
//! end-of-turn token after that point. The end-of-turn token is read off the template too: the
//! first special token it writes after an assistant's content.

use std::path::Path;

use tokenizers::Tokenizer;

use super::chat::Message;
use super::template::ChatTemplate;
use super::PrepareError;

/// A token's byte range in the text it came from.
type Offsets = (usize, usize);

/// Why a conversation yields no sample (counted in the summary, not an error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// No assistant turn: nothing to learn.
    NoAssistant,
    /// The template refused the conversation (its `raise_exception`, e.g. roles not alternating).
    TemplateRejected(String),
    /// Rendering the turns before an answer is not a prefix of the whole conversation's text, so
    /// the answer cannot be located.
    NotPrefixStable,
    /// The tokenizer failed on the text.
    Tokenizer(String),
    /// After `--max-len`, no two consecutive tokens are supervised (no anchor to train on).
    NoSupervisedPair,
}

impl Skip {
    /// A short reason for the summary (one count per reason).
    pub fn reason(&self) -> String {
        match self {
            Skip::NoAssistant => "no assistant turn".into(),
            Skip::TemplateRejected(why) => format!("the chat template refused it ({why})"),
            Skip::NotPrefixStable => "the template renders earlier turns differently once an answer follows".into(),
            Skip::Tokenizer(why) => format!("the tokenizer failed ({why})"),
            Skip::NoSupervisedPair => "no two consecutive supervised tokens (within --max-len)".into(),
        }
    }
}

/// The target's template and tokenizer, with what generation needs to know about turns.
pub struct Encoder {
    pub template: ChatTemplate,
    pub tokenizer: Tokenizer,
    /// The text of the end-of-turn token (`<|im_end|>` for Qwen), if the template has one.
    pub end_of_turn: Option<String>,
    /// Token ids that end a generated answer: the end-of-turn token, the tokenizer config's
    /// `eos_token`, and `eos_token_id` of `generation_config.json` / `config.json`.
    pub stop_ids: Vec<u32>,
    /// Ids `0..tokenizer_vocab` are the tokenizer's (a checkpoint's embedding may be larger).
    pub tokenizer_vocab: usize,
}

impl Encoder {
    /// Loads `tokenizer.json`, the chat template and the stop tokens of the folder `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, PrepareError> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(PrepareError::TargetFile {
                path: tok_path,
                what: "missing: the target folder needs its tokenizer.json (and a chat template)".into(),
            });
        }
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| PrepareError::TargetFile { path: tok_path.clone(), what: format!("not a tokenizer: {e}") })?;
        let template = ChatTemplate::from_dir(dir)?;
        let mut extra = Vec::new();
        for f in ["generation_config.json", "config.json"] {
            let Ok(text) = std::fs::read_to_string(dir.join(f)) else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { continue };
            match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => extra.extend(n.as_u64()),
                Some(serde_json::Value::Array(a)) => extra.extend(a.iter().filter_map(|x| x.as_u64())),
                _ => {}
            }
        }
        let extra = extra.into_iter().filter_map(|x| u32::try_from(x).ok()).collect();
        Ok(Self::new(template, tokenizer, extra))
    }

    /// An encoder from a template and a tokenizer; `extra_stop_ids` are added to the stop set.
    pub fn new(template: ChatTemplate, tokenizer: Tokenizer, extra_stop_ids: Vec<u32>) -> Self {
        let end_of_turn = probe_end_of_turn(&template, &tokenizer);
        let mut stop_ids = extra_stop_ids;
        let eos = template.special("eos_token").map(str::to_string);
        for s in end_of_turn.iter().chain(eos.iter()) {
            stop_ids.extend(tokenizer.token_to_id(s));
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let tokenizer_vocab = tokenizer.get_vocab_size(true);
        Encoder { template, tokenizer, end_of_turn, stop_ids, tokenizer_vocab }
    }

    /// The prompt that asks for the answer after `messages` (rendered with the generation
    /// prompt), tokenized.
    pub fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>, Skip> {
        let text = self.template.render(messages, true).map_err(Skip::TemplateRejected)?;
        Ok(self.tokenize(&text)?.0)
    }

    /// The whole conversation's ids and mask (1 on every assistant answer and its end-of-turn
    /// token, but not on the end-of-turn of an answer that is `unfinished`).
    pub fn encode(&self, messages: &[Message]) -> Result<(Vec<u32>, Vec<u8>), Skip> {
        let answers: Vec<usize> = (0..messages.len()).filter(|&i| messages[i].role == "assistant").collect();
        if answers.is_empty() {
            return Err(Skip::NoAssistant);
        }
        let full = self.template.render(messages, false).map_err(Skip::TemplateRejected)?;
        let mut spans = Vec::with_capacity(answers.len());
        for &a in &answers {
            let before = self.template.render(&messages[..a], true).map_err(Skip::TemplateRejected)?;
            if !full.starts_with(&before) {
                return Err(Skip::NotPrefixStable);
            }
            let start = before.len();
            let eot_len = |e: &str| if messages[a].unfinished { 0 } else { e.len() };
            let end =
                match self.end_of_turn.as_deref().and_then(|e| full[start..].find(e).map(|i| start + i + eot_len(e))) {
                    Some(end) => end,
                    // No end-of-turn token: the answer runs to the next turn's prompt or the end.
                    None => full.trim_end().len().max(start),
                };
            spans.push((start, end));
        }
        let (ids, offsets) = self.tokenize(&full)?;
        let mask =
            offsets.iter().map(|&(s, e)| u8::from(e > s && spans.iter().any(|&(a, b)| s >= a && e <= b))).collect();
        Ok((ids, mask))
    }

    /// The text of generated ids (special tokens kept, as the template will see them).
    pub fn decode(&self, ids: &[u32]) -> Result<String, Skip> {
        self.tokenizer.decode(ids, false).map_err(|e| Skip::Tokenizer(e.to_string()))
    }

    fn tokenize(&self, text: &str) -> Result<(Vec<u32>, Vec<Offsets>), Skip> {
        // add_special_tokens = false: the template writes every special token itself, as
        // `apply_chat_template(tokenize=True)` does.
        let enc = self.tokenizer.encode(text, false).map_err(|e| Skip::Tokenizer(e.to_string()))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }
}

/// The end-of-turn token: the first special (added) token the template writes after an
/// assistant's content. `None` if it writes none (the answer then ends at the next turn).
fn probe_end_of_turn(template: &ChatTemplate, tok: &Tokenizer) -> Option<String> {
    const PROBE: &str = "dflash probe answer";
    let msgs = [Message::new("user", "dflash probe question"), Message::new("assistant", PROBE)];
    let text = template.render(&msgs, false).ok()?;
    let after = &text[text.rfind(PROBE)? + PROBE.len()..];
    let specials: Vec<String> =
        tok.get_added_tokens_decoder().values().filter(|t| t.special).map(|t| t.content.clone()).collect();
    specials
        .into_iter()
        .filter_map(|s| after.find(&s).map(|i| (i, s)))
        .min_by_key(|(i, s)| (*i, usize::MAX - s.len()))
        .map(|(_, s)| s)
}
