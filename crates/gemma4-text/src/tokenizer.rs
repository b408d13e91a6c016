//! The text tokenizer of a checkpoint, loaded from `tokenizer.json` or a GGUF file.

use std::collections::HashSet;
use std::path::Path;

use serde_json::Value;

use crate::error::{Result, TextError};
use crate::gguf::GgufMetadata;
use crate::gguf_tokenizer;
use crate::special::{template_post_processor, MARKUP_TOKENS, STOP_TOKENS};

/// A Gemma tokenizer together with the settings that come with it: the BOS/EOS
/// tokens, whether encoding adds BOS, and the chat template the checkpoint ships.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// The fields of `tokenizer_config.json` this crate uses.
#[derive(Debug, Default)]
struct TokenizerConfig {
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<String>,
}

/// A special token in tokenizer_config.json is either a string or an
/// `AddedToken`-like object with a `content` field.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{"name", "template"}` objects of
/// which the one named `default` is used.
fn template_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Array(entries) => entries.iter().find_map(|entry| {
            (entry.get("name")?.as_str()? == "default")
                .then(|| entry.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TextError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_config(path: &Path) -> Result<TokenizerConfig> {
    let text = read_to_string(path)?;
    let json: Value = serde_json::from_str(&text).map_err(|e| TextError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let map = json.as_object().ok_or_else(|| TextError::Json {
        path: path.to_path_buf(),
        message: "expected a JSON object".to_owned(),
    })?;
    Ok(TokenizerConfig {
        add_bos_token: map.get("add_bos_token").and_then(Value::as_bool),
        add_eos_token: map.get("add_eos_token").and_then(Value::as_bool),
        bos_token: token_string(map.get("bos_token")),
        eos_token: token_string(map.get("eos_token")),
        chat_template: template_string(map.get("chat_template")),
    })
}

impl Tokenizer {
    /// Loads the tokenizer of a Hugging Face style checkpoint directory.
    ///
    /// Reads `tokenizer.json` (required), `tokenizer_config.json` (optional: BOS/EOS
    /// tokens, `add_bos_token`/`add_eos_token`, `chat_template`) and
    /// `chat_template.jinja` (optional, preferred over the config's template).
    /// When the config sets `add_bos_token` or `add_eos_token`, the post-processor
    /// is rebuilt to match; otherwise the one in `tokenizer.json` is kept.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let json_path = dir.join("tokenizer.json");
        if !json_path.is_file() {
            return Err(TextError::MissingTokenizerJson {
                dir: dir.to_path_buf(),
            });
        }
        let bytes = std::fs::read(&json_path).map_err(|source| TextError::Io {
            path: json_path.clone(),
            source,
        })?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TextError::tokenizer(format!("loading {}", json_path.display()), e))?;

        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_config(&config_path)?
        } else {
            TokenizerConfig::default()
        };
        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = if jinja_path.is_file() {
            Some(read_to_string(&jinja_path)?)
        } else {
            config.chat_template.clone()
        };

        let bos_token = config
            .bos_token
            .clone()
            .or_else(|| inner.token_to_id("<bos>").map(|_| "<bos>".to_owned()));
        let eos_token = config
            .eos_token
            .clone()
            .or_else(|| inner.token_to_id("<eos>").map(|_| "<eos>".to_owned()));

        if config.add_bos_token.is_some() || config.add_eos_token.is_some() {
            let add_bos = config.add_bos_token.unwrap_or(false);
            let add_eos = config.add_eos_token.unwrap_or(false);
            let bos = bos_token
                .as_deref()
                .filter(|_| add_bos)
                .and_then(|t| inner.token_to_id(t).map(|id| (t, id)));
            let eos = eos_token
                .as_deref()
                .filter(|_| add_eos)
                .and_then(|t| inner.token_to_id(t).map(|id| (t, id)));
            let processor = template_post_processor(bos, eos)?;
            inner.with_post_processor(Some(processor));
        }

        let mut tokenizer = Tokenizer {
            inner,
            bos_token,
            eos_token,
            add_bos: false,
            chat_template,
        };
        tokenizer.add_bos = tokenizer.post_processor_adds_bos()?;
        Ok(tokenizer)
    }

    /// Builds the tokenizer described by the `tokenizer.ggml.*` metadata of a GGUF
    /// file (`llama`/SentencePiece vocabularies of Gemma 1–3, or `gemma4` BPE).
    ///
    /// For `gemma4` no BOS is added when encoding, whatever the file's
    /// `add_bos_token` says: the chat template writes `<bos>` itself, as the
    /// reference tokenizer assumes. For SentencePiece vocabularies the file's flag
    /// is followed (default: add BOS).
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let meta = GgufMetadata::read(path)?;
        Self::from_gguf_metadata(&meta)
    }

    /// Like [`Tokenizer::from_gguf`], from metadata that was already read.
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Self> {
        let parts = gguf_tokenizer::build(meta)?;
        Ok(Tokenizer {
            inner: parts.tokenizer,
            bos_token: parts.bos_token,
            eos_token: parts.eos_token,
            add_bos: parts.add_bos,
            chat_template: parts.chat_template,
        })
    }

    fn post_processor_adds_bos(&self) -> Result<bool> {
        let Some(bos) = self.bos_id() else {
            return Ok(false);
        };
        let with = self.encode("", true)?;
        Ok(with.first() == Some(&bos))
    }

    /// Token ids of `text`. With `add_special_tokens`, the post-processor runs
    /// (for most Gemma checkpoints: `<bos>` first). Chat prompts rendered by a
    /// template already contain `<bos>` and must be encoded without.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::tokenizer("encoding", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`. With `skip_special`, special (control) tokens are left
    /// out; the Gemma 4 tool and thinking markers that the vocabulary marks as
    /// non-special stay. Ids outside the vocabulary are ignored.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::tokenizer("decoding", e))
    }

    /// The text of `ids` as a user should see it: control tokens such as `<bos>`,
    /// `<eos>` and `<turn|>` are dropped, while the Gemma 4 tool-call and thinking
    /// markers ([`MARKUP_TOKENS`]) are kept whether or not the vocabulary marks
    /// them special.
    pub fn decode_visible(&self, ids: &[u32]) -> Result<String> {
        let hidden = self.hidden_token_ids();
        let kept: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| !hidden.contains(id))
            .collect();
        self.decode(&kept, false)
    }

    /// Ids of special tokens that [`Tokenizer::decode_visible`] drops.
    pub(crate) fn hidden_token_ids(&self) -> HashSet<u32> {
        let keep: HashSet<u32> = MARKUP_TOKENS
            .iter()
            .filter_map(|t| self.token_to_id(t))
            .collect();
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(id, token)| token.special && !keep.contains(id))
            .map(|(id, _)| id)
            .collect()
    }

    /// The id of a token, looked up by its exact spelling (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The spelling of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The BOS token's spelling, if known.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's spelling, if known.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The BOS token's id, if the tokenizer has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The EOS token's id, if the tokenizer has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// Whether `encode(text, true)` puts the BOS token first.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos
    }

    /// The chat template shipped with the tokenizer (`chat_template.jinja`,
    /// tokenizer_config's `chat_template`, or the GGUF's `tokenizer.chat_template`).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Ids that end generation: those of [`STOP_TOKENS`] (`<eos>`, `<turn|>`,
    /// `<|tool_response>`, `<end_of_turn>`) present in this vocabulary, then the
    /// configured EOS token if it is not one of them. No duplicates.
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = Vec::new();
        let candidates = STOP_TOKENS
            .iter()
            .filter_map(|t| self.token_to_id(t))
            .chain(self.eos_id());
        for id in candidates {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The `tokenizer.chat_template` of a GGUF file, or `None` if it has none.
pub fn gguf_chat_template(path: &Path) -> Result<Option<String>> {
    let meta = GgufMetadata::read(path)?;
    Ok(gguf_tokenizer::chat_template_of(&meta))
}

/// The `tokenizer.ggml.add_bos_token` flag exactly as a GGUF file stores it
/// (`None` if absent). Note that [`Tokenizer::from_gguf`] ignores it for Gemma 4.
pub fn gguf_add_bos_token(path: &Path) -> Result<Option<bool>> {
    let meta = GgufMetadata::read(path)?;
    Ok(gguf_tokenizer::add_bos_flag_of(&meta))
}
