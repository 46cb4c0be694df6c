//! Where a running gateway reads its configuration again (a reload): the file it was started
//! with (or the embedded default), the environment, and the command line's overrides. Never a
//! path or a text from a client: the admin route and `SIGHUP` only say "read it again".

use super::defaults::DEFAULT_CONFIG;
use super::loader::load;
use super::types::GatewayConfig;
use std::path::PathBuf;
use std::sync::Arc;

/// What the command line changes in a configuration after it is loaded (`--listen`,
/// `--in-memory`, …), applied again to every reloaded one so that a reload compares like with
/// like.
pub type Overrides = Arc<dyn Fn(&mut GatewayConfig) + Send + Sync>;

/// The source a gateway's configuration is read from, and read again on a reload.
#[derive(Clone)]
pub struct ConfigSource {
    /// The file; `None`: the embedded default configuration.
    path: Option<PathBuf>,
    overrides: Overrides,
}

impl std::fmt::Debug for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSource")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ConfigSource {
    /// The file at `path` (`None`: the embedded default), with `overrides` applied after
    /// each load.
    #[must_use]
    pub fn new(path: Option<PathBuf>, overrides: Overrides) -> ConfigSource {
        ConfigSource { path, overrides }
    }

    /// The file at `path`, as written.
    #[must_use]
    pub fn file(path: impl Into<PathBuf>) -> ConfigSource {
        ConfigSource::new(Some(path.into()), Arc::new(|_| {}))
    }

    /// How errors name the source: the file's path, or the embedded default.
    #[must_use]
    pub fn shown(&self) -> String {
        self.path.as_ref().map_or_else(
            || "embedded default configuration".to_owned(),
            |p| p.display().to_string(),
        )
    }

    /// Reads and validates the configuration now, secrets from the process's environment.
    ///
    /// # Errors
    /// The file cannot be read, or its first problem (the file, the field and the fix).
    pub fn read(&self) -> Result<GatewayConfig, String> {
        let shown = self.shown();
        let text = match &self.path {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("{shown}: cannot read it ({e})"))?,
            None => DEFAULT_CONFIG.to_owned(),
        };
        let mut config =
            load(&text, &shown, &|name| std::env::var(name).ok()).map_err(|e| e.to_string())?;
        (self.overrides)(&mut config);
        Ok(config)
    }
}
