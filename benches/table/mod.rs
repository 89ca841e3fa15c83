//! What the end-to-end benches (`spine`, `dra`) share: a row of the printed table, percentiles,
//! and the table itself.

/// One measurement against its budget.
pub struct Row {
    pub what: &'static str,
    pub value: String,
    pub budget: &'static str,
    pub ok: bool,
}

/// The `p` quantile (0..=1) of already sorted values, nearest rank; NaN for none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

/// The values in ascending order.
pub fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

/// Prints the rows, each with `ok` or `OVER`.
pub fn print(rows: &[Row], what_width: usize) {
    println!("\n{:<what_width$} {:>16}  {:<12}", "measurement", "value", "budget");
    for r in rows {
        println!(
            "{:<what_width$} {:>16}  {:<12} {}",
            r.what,
            r.value,
            r.budget,
            if r.ok { "ok" } else { "OVER" }
        );
    }
}
