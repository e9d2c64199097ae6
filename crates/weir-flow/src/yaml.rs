//! A YAML document as a tree whose every key and value knows where it stood in the file.
//!
//! serde derive over YAML loses positions as soon as a node is internally tagged, and stops at
//! the first error. weir needs every problem of a flow at once, each at its `line:column`, so it
//! builds this tree from the parser's events once and validates the tree.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use saphyr_parser::{Event, Parser, ScalarStyle, Span};

/// A 1-based line and column in a source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Pos {
    pub line: usize,
    pub col: usize,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

impl Pos {
    fn from_span(span: &Span) -> Pos {
        Pos {
            line: span.start.line(),
            col: span.start.col() + 1,
        }
    }
}

/// One value of the tree with its position.
#[derive(Debug, Clone, PartialEq)]
pub struct Yaml {
    pub pos: Pos,
    pub kind: YamlKind,
}

/// How a scalar was written; scripts in block scalars start on the next line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Plain,
    Quoted,
    Block,
}

#[derive(Debug, Clone, PartialEq)]
pub enum YamlKind {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String, Style),
    Seq(Vec<Yaml>),
    /// Keys in file order; duplicate keys are reported while parsing and the later one dropped.
    Map(Vec<(Yaml, Yaml)>),
}

impl Yaml {
    pub fn type_name(&self) -> &'static str {
        match self.kind {
            YamlKind::Null => "null",
            YamlKind::Bool(_) => "a boolean",
            YamlKind::Int(_) => "an integer",
            YamlKind::Float(_) => "a number",
            YamlKind::Str(..) => "a string",
            YamlKind::Seq(_) => "a list",
            YamlKind::Map(_) => "a map",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match &self.kind {
            YamlKind::Str(s, _) => Some(s),
            _ => None,
        }
    }

    pub fn as_map(&self) -> Option<&[(Yaml, Yaml)]> {
        match &self.kind {
            YamlKind::Map(m) => Some(m),
            _ => None,
        }
    }

    /// The value under `key` in a map, with the key's own node.
    pub fn get(&self, key: &str) -> Option<(&Yaml, &Yaml)> {
        self.as_map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(k, v)| (k, v))
    }

    /// The same value without positions, as JSON (map keys become strings).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value;
        match &self.kind {
            YamlKind::Null => Value::Null,
            YamlKind::Bool(b) => Value::Bool(*b),
            YamlKind::Int(i) => Value::from(*i),
            YamlKind::Float(f) => serde_json::Number::from_f64(*f)
                .map(Value::Number)
                .unwrap_or(Value::Null),
            YamlKind::Str(s, _) => Value::String(s.clone()),
            YamlKind::Seq(items) => Value::Array(items.iter().map(Yaml::to_json).collect()),
            YamlKind::Map(entries) => Value::Object(
                entries
                    .iter()
                    .map(|(k, v)| (k.key_string(), v.to_json()))
                    .collect(),
            ),
        }
    }

    /// A map key as text, whatever scalar it was written as.
    pub fn key_string(&self) -> String {
        match &self.kind {
            YamlKind::Str(s, _) => s.clone(),
            YamlKind::Null => "null".into(),
            YamlKind::Bool(b) => b.to_string(),
            YamlKind::Int(i) => i.to_string(),
            YamlKind::Float(f) => f.to_string(),
            YamlKind::Seq(_) | YamlKind::Map(_) => format!("<{}>", self.type_name()),
        }
    }
}

/// A problem found while reading YAML, at a position.
#[derive(Debug, Clone, PartialEq)]
pub struct YamlError {
    pub pos: Pos,
    pub message: String,
}

/// Limits against hostile input: deep nesting and alias bombs cost an error, not the process.
const MAX_DEPTH: usize = 64;
const MAX_NODES: usize = 200_000;

/// Parse one YAML document into a span tree. Syntax errors end the parse (the parser cannot go
/// on); duplicate keys are collected and parsing continues.
pub fn parse(src: &str) -> Result<Yaml, Vec<YamlError>> {
    let mut b = Builder {
        anchors: HashMap::new(),
        errors: Vec::new(),
        nodes: 0,
    };
    let mut parser = Parser::new_from_str(src);
    let mut root = None;
    loop {
        let (ev, span) = match parser.next_event() {
            None => break,
            Some(Ok(x)) => x,
            Some(Err(e)) => {
                return Err(vec![YamlError {
                    pos: Pos {
                        line: e.marker().line(),
                        col: e.marker().col() + 1,
                    },
                    message: format!("YAML syntax: {}", e.info()),
                }])
            }
        };
        match ev {
            Event::StreamStart | Event::DocumentEnd | Event::Nothing => {}
            Event::StreamEnd => break,
            Event::DocumentStart(_) => {
                if root.is_some() {
                    return Err(vec![YamlError {
                        pos: Pos::from_span(&span),
                        message: "a flow file holds one YAML document; found a second".into(),
                    }]);
                }
            }
            ev => {
                let node = b.node(&mut parser, ev, span, 0)?;
                root = Some(node);
            }
        }
    }
    if !b.errors.is_empty() {
        return Err(b.errors);
    }
    Ok(root.unwrap_or(Yaml {
        pos: Pos { line: 1, col: 1 },
        kind: YamlKind::Null,
    }))
}

struct Builder {
    anchors: HashMap<usize, Yaml>,
    errors: Vec<YamlError>,
    nodes: usize,
}

type P<'a> = Parser<'a, saphyr_parser::StrInput<'a>>;

impl Builder {
    fn next<'a>(&mut self, parser: &mut P<'a>) -> Result<(Event<'a>, Span), Vec<YamlError>> {
        match parser.next_event() {
            Some(Ok(x)) => Ok(x),
            Some(Err(e)) => Err(vec![YamlError {
                pos: Pos {
                    line: e.marker().line(),
                    col: e.marker().col() + 1,
                },
                message: format!("YAML syntax: {}", e.info()),
            }]),
            None => Err(vec![YamlError {
                pos: Pos::default(),
                message: "YAML ends in the middle of a value".into(),
            }]),
        }
    }

    fn node<'a>(
        &mut self,
        parser: &mut P<'a>,
        ev: Event<'a>,
        span: Span,
        depth: usize,
    ) -> Result<Yaml, Vec<YamlError>> {
        let pos = Pos::from_span(&span);
        self.nodes += 1;
        if depth > MAX_DEPTH || self.nodes > MAX_NODES {
            return Err(vec![YamlError {
                pos,
                message: format!(
                    "the document is too large or too deeply nested (limits: depth {MAX_DEPTH}, {MAX_NODES} values)"
                ),
            }]);
        }
        let (node, anchor) = match ev {
            Event::Alias(id) => match self.anchors.get(&id) {
                Some(n) => {
                    let mut n = n.clone();
                    self.nodes += count(&n);
                    n.pos = pos;
                    (n, 0)
                }
                None => {
                    return Err(vec![YamlError {
                        pos,
                        message: "alias to an unknown anchor".into(),
                    }])
                }
            },
            Event::Scalar(value, style, anchor, tag) => {
                let kind = scalar(value, style, tag.as_deref().map(|t| t.suffix.as_str()));
                (Yaml { pos, kind }, anchor)
            }
            Event::SequenceStart(anchor, _) => {
                let mut items = Vec::new();
                loop {
                    let (ev, span) = self.next(parser)?;
                    if matches!(ev, Event::SequenceEnd) {
                        break;
                    }
                    items.push(self.node(parser, ev, span, depth + 1)?);
                }
                (
                    Yaml {
                        pos,
                        kind: YamlKind::Seq(items),
                    },
                    anchor,
                )
            }
            Event::MappingStart(anchor, _) => {
                let mut entries: Vec<(Yaml, Yaml)> = Vec::new();
                loop {
                    let (ev, span) = self.next(parser)?;
                    if matches!(ev, Event::MappingEnd) {
                        break;
                    }
                    let key = self.node(parser, ev, span, depth + 1)?;
                    let (ev, span) = self.next(parser)?;
                    let value = self.node(parser, ev, span, depth + 1)?;
                    if let Some((first, _)) = entries.iter().find(|(k, _)| k.kind == key.kind) {
                        self.errors.push(YamlError {
                            pos: key.pos,
                            message: format!(
                                "duplicate key `{}` (first at line {})",
                                key.key_string(),
                                first.pos.line
                            ),
                        });
                        continue;
                    }
                    entries.push((key, value));
                }
                (
                    Yaml {
                        pos,
                        kind: YamlKind::Map(entries),
                    },
                    anchor,
                )
            }
            other => {
                return Err(vec![YamlError {
                    pos,
                    message: format!("unexpected YAML event {other:?}"),
                }])
            }
        };
        if self.nodes > MAX_NODES {
            return Err(vec![YamlError {
                pos,
                message: format!("the document expands to more than {MAX_NODES} values"),
            }]);
        }
        if anchor > 0 {
            self.anchors.insert(anchor, node.clone());
        }
        Ok(node)
    }
}

fn count(y: &Yaml) -> usize {
    match &y.kind {
        YamlKind::Seq(items) => 1 + items.iter().map(count).sum::<usize>(),
        YamlKind::Map(entries) => {
            1 + entries
                .iter()
                .map(|(k, v)| count(k) + count(v))
                .sum::<usize>()
        }
        _ => 1,
    }
}

/// YAML 1.2 core schema resolution of a scalar.
fn scalar(value: Cow<'_, str>, style: ScalarStyle, tag: Option<&str>) -> YamlKind {
    let st = match style {
        ScalarStyle::Plain => Style::Plain,
        ScalarStyle::Literal | ScalarStyle::Folded => Style::Block,
        _ => Style::Quoted,
    };
    if st != Style::Plain || tag == Some("str") {
        return YamlKind::Str(value.into_owned(), st);
    }
    let v = value.as_ref();
    match v {
        "" | "~" | "null" | "Null" | "NULL" => return YamlKind::Null,
        "true" | "True" | "TRUE" => return YamlKind::Bool(true),
        "false" | "False" | "FALSE" => return YamlKind::Bool(false),
        _ => {}
    }
    if let Ok(i) = v.parse::<i64>() {
        return YamlKind::Int(i);
    }
    if let Some(hex) = v.strip_prefix("0x") {
        if let Ok(i) = i64::from_str_radix(hex, 16) {
            return YamlKind::Int(i);
        }
    }
    let looks_numeric = v
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit() || c == '-' || c == '+' || c == '.');
    if looks_numeric && !v.ends_with('.') || matches!(v, ".inf" | "-.inf" | ".nan") {
        let f = match v {
            ".inf" => Some(f64::INFINITY),
            "-.inf" => Some(f64::NEG_INFINITY),
            ".nan" => Some(f64::NAN),
            _ => v.parse::<f64>().ok(),
        };
        if let Some(f) = f {
            return YamlKind::Float(f);
        }
    }
    YamlKind::Str(value.into_owned(), Style::Plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_positions_of_keys_and_values() {
        let y = parse("a: 1\nb:\n  c: [x, \"y\"]\n").unwrap();
        let (k, v) = y.get("b").unwrap();
        assert_eq!(k.pos, Pos { line: 2, col: 1 });
        let (ck, cv) = v.get("c").unwrap();
        assert_eq!(ck.pos, Pos { line: 3, col: 3 });
        match &cv.kind {
            YamlKind::Seq(items) => {
                assert_eq!(items[1].pos, Pos { line: 3, col: 10 });
                assert_eq!(items[1].kind, YamlKind::Str("y".into(), Style::Quoted));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(y.get("a").unwrap().1.kind, YamlKind::Int(1));
    }

    #[test]
    fn duplicate_keys_are_errors_with_position() {
        let e = parse("a: 1\nb: 2\na: 3\n").unwrap_err();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].pos, Pos { line: 3, col: 1 });
        assert!(
            e[0].message.contains("duplicate key `a`"),
            "{}",
            e[0].message
        );
    }

    #[test]
    fn syntax_error_has_position() {
        let e = parse("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(e[0].message.starts_with("YAML syntax"));
        assert!(e[0].pos.line >= 1);
    }

    #[test]
    fn alias_bomb_is_refused() {
        let mut src = String::from("a: &a [1,1,1,1,1,1,1,1,1,1]\n");
        let mut prev = 'a';
        for c in 'b'..='j' {
            src.push_str(&format!(
                "{c}: &{c} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"
            ));
            prev = c;
        }
        let e = parse(&src).unwrap_err();
        assert!(e[0].message.contains("more than"), "{}", e[0].message);
    }
}
