use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::load;

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Model or vocabulary GGUF (default: the bundled demo model).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Treat control tokens such as <|im_start|> as plain text (user-defined ones such as
    /// <think> still match), like llama.cpp's parse_special = false.
    #[arg(long)]
    no_special: bool,
    /// Read the text from a file instead.
    #[arg(long, conflicts_with = "text")]
    file: Option<PathBuf>,
    /// The text to tokenize.
    text: Option<String>,
}

#[derive(clap::Args)]
pub struct DetokenizeArgs {
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Control tokens render as nothing.
    #[arg(long)]
    no_special: bool,
    /// Token ids (decimal; commas also accepted).
    #[arg(required = true, num_args = 1.., value_delimiter = ',')]
    ids: Vec<String>,
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let text = match (&a.text, &a.file) {
        (Some(t), None) => t.clone(),
        (None, Some(p)) => {
            let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            String::from_utf8(bytes).with_context(|| format!("{} is not valid UTF-8", p.display()))?
        }
        _ => bail!("give the text as an argument or with --file PATH"),
    };
    let file = load::open_gguf(a.model.as_deref())?;
    let tok = load::tokenizer(&file)?;
    let ids = tok.encode(&text, !a.no_special);
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

pub fn detokenize(a: DetokenizeArgs) -> Result<()> {
    let file = load::open_gguf(a.model.as_deref())?;
    let tok = load::tokenizer(&file)?;
    let mut ids = Vec::with_capacity(a.ids.len());
    for s in a.ids.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let id: u32 = s.parse().with_context(|| format!("'{s}' is not a token id"))?;
        if id as usize >= tok.n_vocab() {
            bail!("token id {id} is out of range (vocabulary has {} tokens)", tok.n_vocab());
        }
        ids.push(id);
    }
    let bytes = tok.decode(&ids, !a.no_special);
    let mut out = std::io::stdout().lock();
    out.write_all(&bytes)?;
    out.flush()?;
    Ok(())
}
