//! A `java.util.Properties`-compatible text codec (the format of the reference's pull-cursor
//! files), so existing files can be read and ours can be read by Java tools.
//!
//! Writing follows `Properties.store(OutputStream, comments)`: a `#comment` line, then
//! `key=value` lines, in ASCII only. In keys every space is escaped, in values only a leading
//! one; `\`, tab, newline, carriage return, form feed, `=`, `:`, `#` and `!` are
//! backslash-escaped; every other character outside printable ASCII becomes `\uXXXX` (UTF-16
//! surrogate pairs above U+FFFF), so `Properties.load(InputStream)`, which reads ISO-8859-1,
//! reads non-ASCII names right (raw UTF-8 it misreads).
//!
//! Reading follows `Properties.load(Reader)`: blank lines and lines starting (after leading
//! whitespace) with `#` or `!` are comments; a line ending in an odd number of backslashes
//! continues on the next line (leading whitespace of the continuation dropped); the key ends
//! at the first unescaped `=`, `:` or whitespace; escapes `\t \n \r \f \uXXXX` are decoded and
//! any other `\x` stands for `x`. A malformed `\u` escape is an error (Java throws too).

use std::fmt::Write as _;

/// A malformed properties text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {why}")]
pub struct PropertiesError {
    /// 1-based line number where the logical line starts.
    pub line: usize,
    /// What is wrong.
    pub why: String,
}

/// Renders `entries` in order, after one comment line per element of `comments`.
pub fn write<'a>(
    comments: &[&str],
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> String {
    let mut out = String::new();
    for comment in comments {
        // A comment must stay one line, in ASCII.
        out.push('#');
        for ch in comment.chars() {
            match ch {
                '\n' | '\r' => out.push(' '),
                ' '..='~' => out.push(ch),
                other => push_unicode_escape(&mut out, other),
            }
        }
        out.push('\n');
    }
    for (key, value) in entries {
        escape_into(&mut out, key, true);
        out.push('=');
        escape_into(&mut out, value, false);
        out.push('\n');
    }
    out
}

fn escape_into(out: &mut String, text: &str, is_key: bool) {
    for (i, ch) in text.chars().enumerate() {
        match ch {
            ' ' if is_key || i == 0 => out.push_str("\\ "),
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\u{c}' => out.push_str("\\f"),
            '=' | ':' | '#' | '!' => {
                out.push('\\');
                out.push(ch);
            }
            ' '..='~' => out.push(ch),
            other => push_unicode_escape(out, other),
        }
    }
}

/// `\uXXXX` for a character outside printable ASCII (a surrogate pair above U+FFFF).
fn push_unicode_escape(out: &mut String, ch: char) {
    let mut units = [0u16; 2];
    for unit in ch.encode_utf16(&mut units) {
        let _ = write!(out, "\\u{unit:04X}");
    }
}

/// Parses properties text into `(key, value)` pairs in file order (a repeated key appears
/// twice; callers decide, like Java's "last wins").
pub fn parse(text: &str) -> Result<Vec<(String, String)>, PropertiesError> {
    let mut entries = Vec::new();
    let mut lines = text.split('\n').enumerate().peekable();
    while let Some((index, raw)) = lines.next() {
        let start_line = index + 1;
        let first = raw
            .strip_suffix('\r')
            .unwrap_or(raw)
            .trim_start_matches([' ', '\t', '\u{c}']);
        if first.is_empty() || first.starts_with('#') || first.starts_with('!') {
            continue;
        }
        // Join continuation lines: an odd number of trailing backslashes continues.
        let mut logical = String::from(first);
        while ends_with_odd_backslashes(&logical) {
            logical.pop();
            match lines.next() {
                Some((_, next)) => {
                    let next = next.strip_suffix('\r').unwrap_or(next);
                    logical.push_str(next.trim_start_matches([' ', '\t', '\u{c}']));
                }
                None => break,
            }
        }
        let (key, value) = split_key_value(&logical);
        let error = |why: String| PropertiesError {
            line: start_line,
            why,
        };
        entries.push((
            unescape(key).map_err(error)?,
            unescape(value).map_err(error)?,
        ));
    }
    Ok(entries)
}

fn ends_with_odd_backslashes(line: &str) -> bool {
    line.bytes().rev().take_while(|b| *b == b'\\').count() % 2 == 1
}

/// Splits a logical line into raw (still escaped) key and value.
fn split_key_value(line: &str) -> (&str, &str) {
    let bytes = line.as_bytes();
    let mut i = 0;
    let mut key_end = bytes.len();
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'=' | b':' | b' ' | b'\t' | b'\x0c' => {
                key_end = i;
                break;
            }
            _ => i += 1,
        }
    }
    let key_end = key_end.min(bytes.len());
    let mut rest = &line[key_end..];
    rest = rest.trim_start_matches([' ', '\t', '\u{c}']);
    if let Some(stripped) = rest.strip_prefix(['=', ':']) {
        rest = stripped.trim_start_matches([' ', '\t', '\u{c}']);
    }
    (&line[..key_end], rest)
}

fn unescape(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(ch) = chars.next() {
        if ch != '\\' {
            out.push(ch);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('f') => out.push('\u{c}'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let code = (hex.len() == 4)
                    .then(|| u32::from_str_radix(&hex, 16).ok())
                    .flatten()
                    .ok_or_else(|| format!("malformed \\uxxxx escape \\u{hex}"))?;
                // Java pairs surrogates across two escapes; a lone surrogate is not text.
                let decoded = if (0xD800..0xDC00).contains(&code) {
                    let rest: String = chars.by_ref().take(6).collect();
                    let low = rest
                        .strip_prefix("\\u")
                        .and_then(|h| u32::from_str_radix(h, 16).ok())
                        .filter(|low| (0xDC00..0xE000).contains(low))
                        .ok_or_else(|| format!("unpaired surrogate \\u{hex}"))?;
                    char::from_u32(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
                } else {
                    char::from_u32(code)
                };
                out.push(decoded.ok_or_else(|| format!("invalid character \\u{hex}"))?);
            }
            Some(other) => out.push(other),
            // A lone trailing backslash (end of file after a continuation) is dropped, as
            // Java does.
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_like_java() {
        let text = write(
            &["EventMesh pull offsets"],
            [
                ("orders#0", "42"),
                ("a key:=!", " lead"),
                ("tab\there", "x\ny"),
                ("héllo", "wörld"),
                ("emoji😀", "\u{7}"),
            ],
        );
        assert_eq!(
            text,
            "#EventMesh pull offsets\n\
             orders\\#0=42\n\
             a\\ key\\:\\=\\!=\\ lead\n\
             tab\\there=x\\ny\n\
             h\\u00E9llo=w\\u00F6rld\n\
             emoji\\uD83D\\uDE00=\\u0007\n"
        );
        assert!(
            text.is_ascii(),
            "what Properties.load(InputStream) reads right"
        );
        let back = parse(&text).unwrap();
        assert_eq!(back[3], ("héllo".to_owned(), "wörld".to_owned()));
        assert_eq!(back[4], ("emoji😀".to_owned(), "\u{7}".to_owned()));
    }

    #[test]
    fn reads_java_syntax() {
        let text = "# comment\n! also comment\n\n  orders\\#0 = 42\nk2:v2\nk3 v3\nk4=multi\\\n    line\nk5=\\u0041\\u00e9\nk6\n";
        let entries = parse(text).unwrap();
        let got: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("orders#0", "42"),
                ("k2", "v2"),
                ("k3", "v3"),
                ("k4", "multiline"),
                ("k5", "Aé"),
                ("k6", "")
            ]
        );
    }

    #[test]
    fn surrogate_pairs_and_bad_escapes() {
        assert_eq!(parse("k=\\uD83D\\uDE00\n").unwrap()[0].1, "😀");
        assert!(parse("k=\\uD83D\n").is_err());
        let err = parse("a=1\nk=\\u12G4\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(err.why.contains("malformed"), "{err}");
    }

    #[test]
    fn round_trips_awkward_text() {
        let awkward = [
            "",
            " ",
            "a b",
            "=:#!",
            "\\",
            "\\\\n",
            "x\r\ny",
            "\u{1}",
            "日本",
            "trailing ",
        ];
        for key in awkward.iter().filter(|k| !k.is_empty()) {
            for value in awkward {
                let text = write(&[], [(*key, value)]);
                let parsed = parse(&text).unwrap();
                assert_eq!(
                    parsed,
                    [(key.to_string(), value.to_string())],
                    "text {text:?}"
                );
            }
        }
    }
}
