//! The ratio table every benchmark prints.

use std::fmt::Write;

/// One row: a figure's name, its value, and the limit it is bounded by (name and value).
type Row = (String, f64, Option<(String, f64)>);

/// Rows of (figure, value, the limit it is bounded by), printed with their ratio.
#[derive(Default)]
pub struct Table {
    rows: Vec<Row>,
    unit: (String, f64),
}

impl Table {
    /// A table whose values are shown in `unit`, `scale` base units each (e.g. "GB/s", 1e9).
    pub fn new(unit: &str, scale: f64) -> Self {
        Table { rows: Vec::new(), unit: (unit.to_string(), scale) }
    }

    /// A limit row: a figure others are compared with.
    pub fn limit(&mut self, name: &str, value: f64) -> &mut Self {
        self.rows.push((format!("limit: {name}"), value, None));
        self
    }

    /// A figure and the limit (by the name given to [`Table::limit`]) it is a ratio of.
    pub fn figure(&mut self, name: &str, value: f64, limit: &str) -> &mut Self {
        let bound = self
            .rows
            .iter()
            .find(|(n, ..)| n == &format!("limit: {limit}"))
            .map(|(_, v, _)| (limit.to_string(), *v));
        self.rows.push((name.to_string(), value, bound));
        self
    }

    /// The table as text.
    pub fn render(&self) -> String {
        let (unit, scale) = &self.unit;
        let mut out = format!("{:<56} {:>12} {:>8}  of\n", "figure", unit, "ratio");
        for (name, value, bound) in &self.rows {
            let (ratio, of) = match bound {
                Some((limit, v)) if *v > 0.0 => (format!("{:.2}", value / v), limit.as_str()),
                _ => (String::new(), ""),
            };
            let _ = writeln!(out, "{name:<56} {:>12.2} {ratio:>8}  {of}", value / scale);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_printed_as_ratios_of_their_limit() {
        let mut table = Table::new("GB/s", 1e9);
        table
            .limit("memcpy", 10e9)
            .figure("load", 7.5e9, "memcpy")
            .figure("orphan", 1e9, "missing");
        let text = table.render();
        assert!(text.contains("limit: memcpy"));
        let load = text.lines().find(|l| l.starts_with("load")).unwrap();
        assert!(
            load.contains("7.50") && load.contains("0.75") && load.ends_with("memcpy"),
            "{load}"
        );
        let orphan = text.lines().find(|l| l.starts_with("orphan")).unwrap();
        assert!(!orphan.contains("0.10"), "{orphan}");
    }
}
