//! Stop strings over streamed text: what may be sent now, what is held back because it could be
//! the start of a stop string, and where a stop string ends the text.

/// Cuts streamed text at the first stop string, holding back a tail that could begin one.
pub struct StopFilter {
    stops: Vec<String>,
    held: String,
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopFilter {
            stops,
            held: String::new(),
        }
    }

    /// Adds `text`; returns the text that may be sent and whether a stop string was found (then
    /// the text ends just before it, and nothing more should be added).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(i) = first {
            let out = self.held[..i].to_string();
            self.held.clear();
            return (out, true);
        }
        // The longest tail of what is held that is a proper start of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, false)
    }

    /// What is still held back, once no more text comes.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn holds_back_a_possible_stop_and_cuts_at_one() {
        let mut f = StopFilter::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(f.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(f.push("N"), (String::new(), false));
        assert_eq!(f.push("x"), ("ENx".to_string(), false));
        assert_eq!(f.push("yy\n"), ("yy".to_string(), false));
        assert_eq!(f.push("\nmore"), (String::new(), true));
    }

    #[test]
    fn releases_the_held_tail_at_the_end_and_ignores_empty_stops() {
        let mut f = StopFilter::new(vec![String::new(), "é!".into()]);
        assert_eq!(f.push("café"), ("caf".to_string(), false));
        assert_eq!(f.finish(), "é");
        let mut none = StopFilter::new(vec![]);
        assert_eq!(none.push("x"), ("x".to_string(), false));
    }
}
