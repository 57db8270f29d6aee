//! Hand-rolled flag parsing: `--name VALUE`, `--name=VALUE` and bare `--switch`es.

use std::str::FromStr;

/// Why the tool stopped: bad arguments (exit 2, with the usage) or a failure (exit 1).
#[derive(Debug)]
pub enum CliError {
    Usage(String),
    Failed(String),
}

impl From<convkit::Error> for CliError {
    fn from(e: convkit::Error) -> Self {
        CliError::Failed(e.to_string())
    }
}

pub type CliResult<T> = Result<T, CliError>;

/// The flags of one subcommand, after parsing.
pub struct Flags {
    values: Vec<(&'static str, String)>,
    switches: Vec<&'static str>,
}

impl Flags {
    /// Parses `args` against the flags a subcommand knows: `valued` take a value,
    /// `switches` do not. Unknown flags, positional words and repeats are usage errors.
    pub fn parse(
        args: &[String],
        valued: &[&'static str],
        switches: &[&'static str],
    ) -> CliResult<Flags> {
        let mut flags = Flags {
            values: Vec::new(),
            switches: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let Some(body) = arg.strip_prefix("--") else {
                return Err(CliError::Usage(format!("unexpected argument {arg:?}")));
            };
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            if let Some(&known) = valued.iter().find(|&&v| v == name) {
                let value = match inline {
                    Some(v) => v,
                    None => it
                        .next()
                        .cloned()
                        .ok_or_else(|| CliError::Usage(format!("--{name} needs a value")))?,
                };
                if flags.get(known).is_some() {
                    return Err(CliError::Usage(format!("--{name} given twice")));
                }
                flags.values.push((known, value));
            } else if let Some(&known) = switches.iter().find(|&&s| s == name) {
                if inline.is_some() {
                    return Err(CliError::Usage(format!("--{name} takes no value")));
                }
                flags.switches.push(known);
            } else {
                return Err(CliError::Usage(format!("unknown option --{name}")));
            }
        }
        Ok(flags)
    }

    /// The raw value of `--name`, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The value of a flag that must be given.
    pub fn required(&self, name: &str) -> CliResult<&str> {
        self.get(name)
            .ok_or_else(|| CliError::Usage(format!("--{name} is required")))
    }

    pub fn has(&self, name: &str) -> bool {
        self.switches.contains(&name)
    }

    /// `--name` parsed as a `T`; a value that does not parse is a usage error.
    pub fn parsed<T: FromStr>(&self, name: &str) -> CliResult<Option<T>>
    where
        T::Err: std::fmt::Display,
    {
        self.get(name)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|e| CliError::Usage(format!("--{name} {v:?}: {e}")))
            })
            .transpose()
    }
}
