//! Python semantics the HF renderer gets for free from CPython: `str()`/`repr()` of values,
//! `json.dumps` (the `tojson` filter HF installs) and `datetime.strftime`.
//!
//! Floats are the reason this file exists: minijinja prints `1e-7` as `0.0000001` and serde
//! prints `1e-7`, while Python prints `1e-07`; tool schemas and tool-call arguments carry such
//! numbers, and byte-exact prompts depend on them.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python `repr(float)` (== `str(float)` == `json.dumps` for finite values): the shortest
/// round-trip digits, fixed notation for decimal exponents -4..=15, else `d.ddde±XX`.
pub fn write_float(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("nan");
        return;
    }
    if v.is_infinite() {
        out.push_str(if v < 0.0 { "-inf" } else { "inf" });
        return;
    }
    if v == 0.0 {
        out.push_str(if v.is_sign_negative() { "-0.0" } else { "0.0" });
        return;
    }
    // Rust's `{:e}` is the shortest round-trip representation, as is Python's repr
    // (both are David Gay / Grisu-exact shortest digits): "-1.2345e-7".
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0")); // `{:e}` always has an 'e'
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if neg {
        out.push('-');
    }
    // CPython float_repr_style 'r': exponent form when decpt <= -4 or decpt > 16, where
    // decpt = exp + 1 (Python/pystrtod.c, format_float_short).
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let n_int = exp as usize + 1;
            if digits.len() <= n_int {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', n_int - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..n_int]);
                out.push('.');
                out.push_str(&digits[n_int..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.unsigned_abs());
    }
}

/// Float payload of a number value, `None` for integers.
fn as_float(v: &Value) -> Option<f64> {
    if v.kind() == ValueKind::Number && !v.is_integer() { f64::try_from(v.clone()).ok() } else { None }
}

/// Python `str(v)`: strings as they are, everything else as `repr`.
pub fn py_str(v: &Value) -> String {
    let mut out = String::new();
    match v.as_str() {
        Some(s) => out.push_str(s),
        None if v.is_undefined() => {}
        None => write_repr(&mut out, v),
    }
    out
}

/// Python `repr(v)` for the values a JSON request can produce (dicts keep insertion order).
/// Other objects (macros, namespaces, loop state) fall back to minijinja's own display.
pub fn write_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => match as_float(v) {
            Some(f) => write_float(out, f),
            None => {
                let _ = write!(out, "{v}");
            }
        },
        ValueKind::String => write_str_repr(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(iter) = v.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = v.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    write_repr(out, &v.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Python `repr(str)`: single quotes unless the text holds `'` and no `"`; non-printable
/// characters escaped. Printability is approximated by the control and format characters a
/// request plausibly contains (C0, DEL, C1, NBSP, soft hyphen, zero-width and bidi marks,
/// line/paragraph separators, BOM); CPython's full `isprintable` table is not reproduced.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            '\0'..='\x1f' | '\x7f'..='\u{a0}' | '\u{ad}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{feff}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Options of Python's `json.dumps` that HF's `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` exposes.
#[derive(Debug, Clone)]
pub struct JsonOpts {
    pub ensure_ascii: bool,
    /// Per-level indent; `None` = single line.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for JsonOpts {
    fn default() -> Self {
        JsonOpts { ensure_ascii: false, indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false }
    }
}

/// `json.dumps(v, **opts)`. Undefined values and non-data objects are errors, as in Python
/// ("Object of type Undefined is not JSON serializable").
pub fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match as_float(v) {
            Some(f) if f.is_nan() => out.push_str("NaN"),
            Some(f) if f.is_infinite() => out.push_str(if f < 0.0 { "-Infinity" } else { "Infinity" }),
            Some(f) => write_float(out, f),
            None => {
                let _ = write!(out, "{v}");
            }
        },
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                entries.push((json_key(&key)?, value));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_json_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, value, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("Object of type {kind} is not JSON serializable")));
        }
    }
    Ok(())
}

fn newline_indent(out: &mut String, opts: &JsonOpts, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// Python's conversion of dict keys: str as is, numbers/bools/None as their JSON text.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            let mut s = String::new();
            write_json(&mut s, key, &JsonOpts::default(), 0)?;
            Ok(s)
        }
        kind => Err(Error::new(ErrorKind::InvalidOperation, format!("keys must be str, int, float, bool or None, not {kind}"))),
    }
}

/// `json.encoder.py_encode_basestring(_ascii)`: lowercase `\uXXXX`, surrogate pairs when ASCII.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    write_json_str_body(out, s, ensure_ascii);
    out.push('"');
}

/// The inside of a JSON string literal: `s` escaped, no quotes. Escaping is per char, so the
/// escaped pieces of a split string concatenate to the escaped whole.
pub(crate) fn write_json_str_body(out: &mut String, s: &str, ensure_ascii: bool) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
}

/// `datetime.strftime` for a UTC Unix time. Supports the directives chat templates use
/// (`%Y %m %d %H %M %S %y %b %B %a %A %j %p %I %e %Z %z %%` and glibc's `%-d`-style
/// unpadded forms); any other directive is copied through, as glibc does.
pub fn strftime_utc(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => num(&mut out, year, 4),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:2}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31) (H. Hinnant, `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Inverse of [`civil_from_days`] (H. Hinnant, `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn float(v: f64) -> String {
        let mut s = String::new();
        write_float(&mut s, v);
        s
    }

    #[test]
    fn float_repr_matches_python() {
        // Expected strings are CPython 3.12 `repr(x)`.
        let cases: &[(f64, &str)] = &[
            (1.0, "1.0"),
            (-2.0, "-2.0"),
            (0.5, "0.5"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e-7, "1e-07"),
            (2.5e-5, "2.5e-05"),
            (0.0001, "0.0001"),
            (0.00012345, "0.00012345"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789.123, "123456789.123"),
            (1e22, "1e+22"),
            (1e300, "1e+300"),
            (-1.25e-300, "-1.25e-300"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (100.0, "100.0"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for &(v, want) in cases {
            assert_eq!(float(v), want, "repr({v:e})");
        }
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            strftime_utc("%d %b %Y|%A|%a|%B|%j|%I%p|%-d/%-m|%y|%%|%Q", t),
            "29 Feb 2024|Thursday|Thu|February|060|01PM|29/2|24|%|%Q"
        );
        assert_eq!(strftime_utc("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime_utc("%Y-%m-%d", -86_400), "1969-12-31");
    }
}
