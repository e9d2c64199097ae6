//! A serde `Deserializer` over the span tree, so node configs can be plain
//! `#[serde(deny_unknown_fields)]` structs while every error still points at its line.
//!
//! The innermost value that fails attaches its position to the error; outer values leave a
//! positioned error alone. An unknown field is reported at its key, a missing one at the map.

use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::yaml::{Pos, Yaml, YamlKind};

/// A deserialization error, positioned once it passes through the value it concerns.
#[derive(Debug, Clone, PartialEq)]
pub struct DeError {
    pub pos: Option<Pos>,
    pub message: String,
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pos {
            Some(p) => write!(f, "{p}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError {
            pos: None,
            message: msg.to_string(),
        }
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        let hint = suggest(field, expected)
            .map(|s| format!(", did you mean `{s}`?"))
            .unwrap_or_else(|| {
                if expected.is_empty() {
                    String::new()
                } else {
                    format!(" (expected one of: {})", expected.join(", "))
                }
            });
        DeError::custom(format_args!("unknown field `{field}`{hint}"))
    }

    fn missing_field(field: &'static str) -> Self {
        DeError::custom(format_args!("missing required field `{field}`"))
    }
}

/// The closest expected name, when it is close enough to be a likely typo.
pub fn suggest<'a>(given: &str, expected: &[&'a str]) -> Option<&'a str> {
    expected
        .iter()
        .map(|e| (levenshtein(given, e), *e))
        .filter(|(d, e)| *d < e.len() && *d <= 1.max(e.len() / 2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, e)| e)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

fn at(pos: Pos) -> impl Fn(DeError) -> DeError {
    move |mut e| {
        if e.pos.is_none() {
            e.pos = Some(pos);
        }
        e
    }
}

/// Deserialize a `T` from a node of the span tree.
pub fn from_yaml<'a, T: Deserialize<'a>>(y: &'a Yaml) -> Result<T, DeError> {
    T::deserialize(y).map_err(at(y.pos))
}

/// A value that remembers where it was written. Deserializes from any node of the span tree.
#[derive(Debug, Clone, PartialEq)]
pub struct Spanned<T> {
    pub pos: Pos,
    pub value: T,
}

impl<T> std::ops::Deref for Spanned<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

const SPANNED: &str = "$weir::Spanned";
const SPANNED_FIELDS: &[&str] = &["$line", "$col", "$value"];

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Spanned<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Spanned<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Spanned<T>, A::Error> {
                let _: Option<String> = m.next_key()?;
                let line: usize = m.next_value()?;
                let _: Option<String> = m.next_key()?;
                let col: usize = m.next_value()?;
                let _: Option<String> = m.next_key()?;
                let value: T = m.next_value()?;
                Ok(Spanned {
                    pos: Pos { line, col },
                    value,
                })
            }
        }
        d.deserialize_struct(SPANNED, SPANNED_FIELDS, V(std::marker::PhantomData))
    }
}

impl<'de> de::Deserializer<'de> for &'de Yaml {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DeError> {
        let r = match &self.kind {
            YamlKind::Null => v.visit_unit(),
            YamlKind::Bool(b) => v.visit_bool(*b),
            YamlKind::Int(i) => v.visit_i64(*i),
            YamlKind::Float(f) => v.visit_f64(*f),
            YamlKind::Str(s, _) => v.visit_borrowed_str(s),
            YamlKind::Seq(items) => v.visit_seq(Seq { it: items.iter() }),
            YamlKind::Map(entries) => v.visit_map(Map {
                it: entries.iter(),
                value: None,
            }),
        };
        r.map_err(at(self.pos))
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DeError> {
        match self.kind {
            YamlKind::Null => v.visit_none(),
            _ => v.visit_some(self).map_err(at(self.pos)),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DeError> {
        // Numbers and booleans written where text is expected are taken as their text
        // (`topic: 42`), as a person writing YAML would expect.
        match &self.kind {
            YamlKind::Int(i) => v.visit_string(i.to_string()),
            YamlKind::Float(f) => v.visit_string(f.to_string()),
            YamlKind::Bool(b) => v.visit_string(b.to_string()),
            _ => return self.deserialize_any(v),
        }
        .map_err(at(self.pos))
    }

    fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DeError> {
        self.deserialize_string(v)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DeError> {
        match &self.kind {
            YamlKind::Int(i) => v.visit_f64(*i as f64).map_err(at(self.pos)),
            _ => self.deserialize_any(v),
        }
    }

    fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DeError> {
        self.deserialize_f64(v)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, DeError> {
        match &self.kind {
            YamlKind::Str(s, _) => v
                .visit_enum(s.as_str().into_deserializer())
                .map_err(at(self.pos)),
            _ => Err(DeError {
                pos: Some(self.pos),
                message: format!("expected one word, found {}", self.type_name()),
            }),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, DeError> {
        if name == SPANNED {
            return v
                .visit_map(SpannedAccess { y: self, step: 0 })
                .map_err(at(self.pos));
        }
        let _ = fields;
        match &self.kind {
            YamlKind::Map(_) => self.deserialize_any(v),
            _ => Err(DeError {
                pos: Some(self.pos),
                message: format!("expected a map, found {}", self.type_name()),
            }),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 char
        bytes byte_buf unit unit_struct newtype_struct seq tuple
        tuple_struct map identifier ignored_any
    }
}

struct Seq<'a> {
    it: std::slice::Iter<'a, Yaml>,
}

impl<'de> SeqAccess<'de> for Seq<'de> {
    type Error = DeError;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        match self.it.next() {
            Some(y) => seed.deserialize(y).map(Some).map_err(at(y.pos)),
            None => Ok(None),
        }
    }
}

struct Map<'a> {
    it: std::slice::Iter<'a, (Yaml, Yaml)>,
    value: Option<&'a Yaml>,
}

impl<'de> MapAccess<'de> for Map<'de> {
    type Error = DeError;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        match self.it.next() {
            Some((k, v)) => {
                self.value = Some(v);
                seed.deserialize(k).map(Some).map_err(at(k.pos))
            }
            None => Ok(None),
        }
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, DeError> {
        let v = self
            .value
            .take()
            .ok_or_else(|| <DeError as de::Error>::custom("value without a key"))?;
        seed.deserialize(v).map_err(at(v.pos))
    }
}

struct SpannedAccess<'a> {
    y: &'a Yaml,
    step: usize,
}

impl<'de> MapAccess<'de> for SpannedAccess<'de> {
    type Error = DeError;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        if self.step >= 3 {
            return Ok(None);
        }
        seed.deserialize(SPANNED_FIELDS[self.step].into_deserializer())
            .map(Some)
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, DeError> {
        let step = self.step;
        self.step += 1;
        match step {
            0 => seed.deserialize(self.y.pos.line.into_deserializer()),
            1 => seed.deserialize(self.y.pos.col.into_deserializer()),
            _ => seed.deserialize(self.y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::yaml::parse;

    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Cfg {
        path: String,
        #[serde(default)]
        to: Vec<Spanned<String>>,
        #[serde(default)]
        timeout: Option<u32>,
    }

    #[test]
    fn unknown_field_points_at_key_with_suggestion() {
        let y = parse("paht: x\nto: [a]\n").unwrap();
        let e = from_yaml::<Cfg>(&y).unwrap_err();
        assert_eq!(e.pos, Some(Pos { line: 1, col: 1 }));
        assert!(e.message.contains("did you mean `path`"), "{}", e.message);
    }

    #[test]
    fn missing_field_points_at_map() {
        let y = parse("\n  to: [a]\n").unwrap();
        let e = from_yaml::<Cfg>(&y).unwrap_err();
        assert_eq!(e.pos, Some(Pos { line: 2, col: 3 }));
        assert!(e.message.contains("missing required field `path`"));
    }

    #[test]
    fn wrong_type_points_at_value_and_spans_are_kept() {
        let y = parse("path: x\ntimeout: lots\n").unwrap();
        let e = from_yaml::<Cfg>(&y).unwrap_err();
        assert_eq!(e.pos, Some(Pos { line: 2, col: 10 }));
        let y = parse("path: x\nto:\n  - a\n  - b\n").unwrap();
        let c = from_yaml::<Cfg>(&y).unwrap();
        assert_eq!(c.to[1].pos, Pos { line: 4, col: 5 });
        assert_eq!(c.to[1].value, "b");
    }
}
