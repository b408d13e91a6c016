//! `strftime_now(format)`, the date helper transformers gives chat templates.
//!
//! Python formats the local time; this formats UTC, which is what servers and
//! containers usually run in. The common directives are supported (`%Y %m %d %e
//! %H %I %M %S %p %y %b %B %a %A %j %%`, and the glibc `-` flag that drops
//! zero padding); other directives are copied through unchanged.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilTime {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday.
    weekday: u32,
    /// 1-based day of the year.
    yearday: u32,
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

impl CivilTime {
    /// The UTC time `secs` seconds after the Unix epoch.
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Days to civil date (proleptic Gregorian), after H. Hinnant's algorithm.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yearday =
            CUMULATIVE[(month - 1) as usize] + day + u32::from(month > 2 && is_leap(year));
        CivilTime {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem / 60 % 60) as u32,
            second: (rem % 60) as u32,
            // 1970-01-01 was a Thursday (3 when Monday is 0).
            weekday: (days + 3).rem_euclid(7) as u32,
            yearday,
        }
    }

    /// The current UTC time.
    pub fn now() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        Self::from_unix(secs)
    }

    /// Formats the time with a C/Python `strftime` format string.
    pub fn format(&self, fmt: &str) -> String {
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
            let Some(directive) = chars.next() else {
                out.push('%');
                break;
            };
            let num = |v: u32, width: usize| {
                if unpadded {
                    v.to_string()
                } else {
                    format!("{v:0width$}")
                }
            };
            let hour12 = match self.hour % 12 {
                0 => 12,
                h => h,
            };
            let piece = match directive {
                'Y' => self.year.to_string(),
                'y' => format!("{:02}", self.year.rem_euclid(100)),
                'm' => num(self.month, 2),
                'd' => num(self.day, 2),
                'e' => format!("{:>2}", self.day),
                'H' => num(self.hour, 2),
                'I' => num(hour12, 2),
                'M' => num(self.minute, 2),
                'S' => num(self.second, 2),
                'j' => num(self.yearday, 3),
                'p' => if self.hour < 12 { "AM" } else { "PM" }.to_owned(),
                'B' => MONTHS[(self.month - 1) as usize].to_owned(),
                'b' | 'h' => MONTHS[(self.month - 1) as usize][..3].to_owned(),
                'A' => DAYS[self.weekday as usize].to_owned(),
                'a' => DAYS[self.weekday as usize][..3].to_owned(),
                '%' => "%".to_owned(),
                other => {
                    let mut s = String::from('%');
                    if unpadded {
                        s.push('-');
                    }
                    s.push(other);
                    s
                }
            };
            out.push_str(&piece);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::CivilTime;

    #[test]
    fn formats_known_instants() {
        // 2024-02-29T13:05:09Z, a Thursday.
        let t = CivilTime::from_unix(1_709_211_909);
        assert_eq!(
            t.format("%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p"),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 01PM"
        );
        assert_eq!(t.format("%-d %b %Y, %e"), "29 Feb 2024, 29");
        let epoch = CivilTime::from_unix(0);
        assert_eq!(epoch.format("%d %B %Y %A %%"), "01 January 1970 Thursday %");
        // 1969-12-31T23:59:59Z
        assert_eq!(
            CivilTime::from_unix(-1).format("%Y-%m-%d %H:%M:%S %j"),
            "1969-12-31 23:59:59 365"
        );
    }
}
