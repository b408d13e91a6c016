//! Every number ends. A JSON grammar lets a number run on for ever: llguidance
//! gives a number's fraction no length limit, even within bounds
//! (`3.33333…` ≤ 8) or with `multipleOf` (`0.125000…`), and a model that
//! keeps writing digits never reaches `max_tokens`' end of the reply any
//! sooner. On top of a JSON or tool-call grammar's mask, this keeps every
//! number to what a double holds: at most 17 mantissa digits and a
//! two-digit exponent. It lexes the text the grammar has accepted so far,
//! so it knows whether the next token continues a number, sits in a string
//! or in a bare key, and drops from the mask the tokens that would write a
//! number past the limit. When that leaves nothing (a bound that needs more
//! digits), the grammar's own mask stands: it never blocks a grammar.

use llguidance::toktrie::{TokEnv, TokTrie};

/// Most digits before the exponent: what a double holds.
pub const MANTISSA_DIGITS: u8 = 17;
/// Most digits of an exponent.
pub const EXPONENT_DIGITS: u8 = 2;

/// How the text being lexed quotes its strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quoting {
    /// JSON: `"…"` with backslash escapes.
    Json,
    /// Gemma 4's tool calls: text between two of this token, verbatim.
    Delimiter(u32),
}

/// Where the lexer stands in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lexeme {
    /// Between values: punctuation, white space, markup.
    Between,
    /// A bare word: `true`, a bare key, a function's name.
    Word,
    /// Inside a string (`escaped`: after a backslash in JSON).
    Str { escaped: bool },
    /// A number's sign, integer and fraction: the digits written.
    Mantissa(u8),
    /// A number's exponent: the digits written.
    Exponent(u8),
}

impl Lexeme {
    /// The state after one byte of ordinary text.
    fn byte(self, b: u8, quoting: Quoting) -> Lexeme {
        let json = quoting == Quoting::Json;
        match self {
            Lexeme::Str { escaped } if json => match (escaped, b) {
                (true, _) => Lexeme::Str { escaped: false },
                (false, b'\\') => Lexeme::Str { escaped: true },
                (false, b'"') => Lexeme::Between,
                _ => Lexeme::Str { escaped: false },
            },
            Lexeme::Str { .. } => self,
            Lexeme::Mantissa(n) => match b {
                b'0'..=b'9' => Lexeme::Mantissa(n.saturating_add(1)),
                b'.' => self,
                b'e' | b'E' => Lexeme::Exponent(0),
                _ => Lexeme::Between.byte(b, quoting),
            },
            Lexeme::Exponent(n) => match b {
                b'0'..=b'9' => Lexeme::Exponent(n.saturating_add(1)),
                b'+' | b'-' => self,
                _ => Lexeme::Between.byte(b, quoting),
            },
            Lexeme::Word => match b {
                b if b.is_ascii_alphanumeric() || b >= 0x80 => self,
                b'_' | b'-' | b'.' | b'$' | b'@' => self,
                _ => Lexeme::Between.byte(b, quoting),
            },
            Lexeme::Between => match b {
                b'0'..=b'9' => Lexeme::Mantissa(1),
                b'-' => Lexeme::Mantissa(0),
                b'"' if json => Lexeme::Str { escaped: false },
                b if b.is_ascii_alphabetic() || b == b'_' || b >= 0x80 => Lexeme::Word,
                _ => Lexeme::Between,
            },
        }
    }

    /// Whether a number has run past the limit; a `.` at the last mantissa
    /// digit counts, since a fraction digit must follow it.
    fn over(self, last: u8) -> bool {
        match self {
            Lexeme::Mantissa(n) => n > MANTISSA_DIGITS || (n == MANTISSA_DIGITS && last == b'.'),
            Lexeme::Exponent(n) => n > EXPONENT_DIGITS,
            _ => false,
        }
    }

    fn in_number(self) -> bool {
        matches!(self, Lexeme::Mantissa(_) | Lexeme::Exponent(_))
    }
}

/// Per vocabulary: each token's bytes and which tokens can lengthen a number.
pub struct NumberTokens {
    env: TokEnv,
    /// Tokens holding a digit or `.`: the ones that can continue a number.
    numeric: Vec<u32>,
    /// Tokens holding more than [`EXPONENT_DIGITS`] digits: the ones that
    /// can break the limit alone, outside a number.
    long: Vec<u32>,
}

impl NumberTokens {
    pub fn new(env: TokEnv) -> Self {
        let trie = env.tok_trie();
        let words = trie.vocab_size().div_ceil(32);
        let (mut numeric, mut long) = (vec![0u32; words], vec![0u32; words]);
        for t in 0..trie.vocab_size() as u32 {
            let bytes = trie.token(t);
            if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                continue;
            }
            let digits = bytes.iter().filter(|b| b.is_ascii_digit()).count();
            if digits > 0 || bytes.contains(&b'.') {
                numeric[t as usize / 32] |= 1 << (t % 32);
            }
            if digits > usize::from(EXPONENT_DIGITS) {
                long[t as usize / 32] |= 1 << (t % 32);
            }
        }
        Self { env, numeric, long }
    }
}

/// One sequence's lexer over the text its grammar accepted.
pub struct NumberLimit {
    lexeme: Lexeme,
    quoting: Quoting,
}

impl NumberLimit {
    pub fn new(quoting: Quoting) -> Self {
        Self {
            lexeme: Lexeme::Between,
            quoting,
        }
    }

    /// The state after `token`, and whether it wrote a number past the limit.
    fn after(&self, tokens: &NumberTokens, token: u32) -> (Lexeme, bool) {
        if let Quoting::Delimiter(quote) = self.quoting {
            if token == quote {
                let next = match self.lexeme {
                    Lexeme::Str { .. } => Lexeme::Between,
                    _ => Lexeme::Str { escaped: false },
                };
                return (next, false);
            }
        }
        let bytes = tokens.env.tok_trie().token(token);
        if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
            // Markup ends a number or word; inside a string it is text.
            return match self.lexeme {
                Lexeme::Str { .. } => (self.lexeme, false),
                _ => (Lexeme::Between, false),
            };
        }
        let mut lexeme = self.lexeme;
        let mut over = false;
        for &b in bytes {
            lexeme = lexeme.byte(b, self.quoting);
            over |= lexeme.over(b);
        }
        (lexeme, over)
    }

    /// Records a token the grammar accepted.
    pub fn accept(&mut self, tokens: &NumberTokens, token: u32) {
        self.lexeme = self.after(tokens, token).0;
    }

    /// Drops from `mask` the tokens that would write a number past the
    /// limit, unless that would leave none.
    pub fn restrict(&self, tokens: &NumberTokens, mask: &mut [u32]) {
        let suspects = if self.lexeme.in_number() {
            &tokens.numeric
        } else {
            &tokens.long
        };
        let mut dropped = Vec::new();
        for (w, (word, suspect)) in mask.iter().zip(suspects).enumerate() {
            let mut bits = word & suspect;
            while bits != 0 {
                let t = (w * 32) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                if self.after(tokens, t).1 {
                    dropped.push(t);
                }
            }
        }
        if dropped.is_empty() {
            return;
        }
        let kept = mask.to_vec();
        for t in &dropped {
            mask[*t as usize / 32] &= !(1 << (t % 32));
        }
        if mask.iter().all(|&w| w == 0) {
            mask.copy_from_slice(&kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lex(text: &str, quoting: Quoting) -> (Lexeme, bool) {
        let mut lexeme = Lexeme::Between;
        let mut over = false;
        for b in text.bytes() {
            lexeme = lexeme.byte(b, quoting);
            over |= lexeme.over(b);
        }
        (lexeme, over)
    }

    #[test]
    fn numbers_are_counted_where_they_are_numbers() {
        let json = Quoting::Json;
        assert_eq!(lex("{\"a\": 12.5", json).0, Lexeme::Mantissa(3));
        assert_eq!(lex("[-0.25e+1", json).0, Lexeme::Exponent(1));
        // Digits in strings, escaped quotes and bare words are not numbers.
        assert_eq!(
            lex("{\"k\\\"123456789012345678901\": ", json),
            (Lexeme::Between, false)
        );
        assert_eq!(lex("{\"a\": true", json).0, Lexeme::Word);
        let call = Quoting::Delimiter(7);
        assert_eq!(lex("call:f2{x123:4", call).0, Lexeme::Mantissa(1));
    }

    #[test]
    fn the_limit_is_a_doubles_digits_and_a_two_digit_exponent() {
        let json = Quoting::Json;
        assert!(!lex("[12345678901234567", json).1);
        assert!(lex("[123456789012345678", json).1);
        assert!(!lex("[1234567890.1234567", json).1);
        assert!(lex("[1234567890.12345678", json).1);
        // No `.` after the last digit a double holds: a digit must follow it.
        assert!(lex("[12345678901234567.", json).1);
        assert!(!lex("[1.5e-12", json).1);
        assert!(lex("[1.5e-123", json).1);
        // A new number starts its own count.
        assert!(!lex("[1234567890123456, 1234567890123456", json).1);
    }
}
