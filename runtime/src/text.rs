//! Text from outside (a registry's error, an API server's message, a module's attribute name)
//! repeated in the agent's own messages: cut short and on one line, so an error, a log line or
//! `status` can never carry a payload.

/// `text`'s first `max` characters, control characters made spaces, `…` when cut.
pub fn cut(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_cut_to_one_short_line() {
        let long = "x\n".repeat(10_000);
        let cut = cut(&long, 200);
        assert_eq!(cut.chars().count(), 201);
        assert!(!cut.contains('\n'));
        assert_eq!(super::cut("fine", 200), "fine");
    }
}
