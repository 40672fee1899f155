//! `ember`: the command-line front end. Flags, wiring and output formatting only; everything
//! worth testing lives in the library crates.

mod bench;
mod bench_http;
mod chat;
mod device;
mod inspect;
mod load;
mod logits;
mod models;
mod plan;
mod run;
mod serve;
mod synth;
mod tokenize;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ember",
    version,
    about = "Inference engine for hybrid MoE models (Qwen3.5/3.6 qwen35moe GGUF)",
    after_help = "Models: `-m FILE`, or `-hf OWNER/REPO[:QUANT]` (also `--hf-repo`) for a model in the local \
                  Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub; see `ember models`). \
                  A split model (NAME-00001-of-0000N.gguf) is opened by its first part."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Read model files into memory instead of memory-mapping them.
    #[arg(long, global = true)]
    no_mmap: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Architecture, hyper-parameters, tokenizer and tensors of a GGUF file.
    Inspect(inspect::Args),
    /// Text to token ids (a JSON array; no BOS is added).
    Tokenize(tokenize::TokenizeArgs),
    /// Token ids to text: exactly the decoded bytes on stdout.
    Detokenize(tokenize::DetokenizeArgs),
    /// Logits of every position of a token sequence, written as safetensors.
    Logits(logits::Args),
    /// Generate a continuation of a prompt, streamed to stdout.
    Run(run::Args),
    /// Chat in the terminal: multi-turn, streamed, the prompt cache reused across turns.
    Chat(chat::Args),
    /// OpenAI-compatible HTTP server (chat, completions, tools, streaming, /metrics).
    Serve(serve::Args),
    /// Write a synthetic qwen35moe GGUF (random weights, real tokenizer) of any shape.
    Synth(synth::Args),
    /// Prompt and generation throughput at depths, in process (llama-bench style names).
    Bench(bench::Args),
    /// Prompt and generation throughput of an OpenAI-compatible server, as a user sees it.
    BenchHttp(bench_http::Args),
    /// GGUF models in the local Hugging Face cache (what `-hf` can open).
    Models(models::Args),
    /// Where the model would live: layers and experts per GPU and in host memory.
    Plan(plan::Args),
}

/// An error and its causes on one line, "a: b: c", each cause once: many of our error types
/// print their inner error in their own message (so `to_string()` alone says everything), and
/// anyhow's `{:#}` would then print that cause a second time.
pub(crate) fn report(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if msg.ends_with(&c) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&c);
    }
    msg
}

fn main() {
    let args = match models::expand_hf_args(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            std::process::exit(1);
        }
    };
    let cli = Cli::parse_from(args);
    load::set_no_mmap(cli.no_mmap);
    let result = match cli.cmd {
        Cmd::Inspect(a) => inspect::main(a),
        Cmd::Plan(a) => plan::main(a),
        Cmd::Tokenize(a) => tokenize::tokenize(a),
        Cmd::Detokenize(a) => tokenize::detokenize(a),
        Cmd::Logits(a) => logits::main(a),
        Cmd::Run(a) => run::main(a),
        Cmd::Chat(a) => chat::main(a),
        Cmd::Serve(a) => serve::main(a),
        Cmd::Synth(a) => synth::main(a),
        Cmd::Bench(a) => bench::main(a),
        Cmd::BenchHttp(a) => bench_http::main(a),
        Cmd::Models(a) => models::main(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", report(&e));
        std::process::exit(1);
    }
}
