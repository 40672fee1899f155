//! `ember`: the command-line front end. Flags, wiring and output formatting only; everything
//! worth testing lives in the library crates.

mod bench;
mod bench_http;
mod inspect;
mod load;
mod logits;
mod run;
mod serve;
mod synth;
mod tokenize;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ember", version, about = "Inference engine for hybrid MoE models (Qwen3.5/3.6 qwen35moe GGUF)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
    /// OpenAI-compatible HTTP server (chat, completions, tools, streaming, /metrics).
    Serve(serve::Args),
    /// Write a synthetic qwen35moe GGUF (random weights, real tokenizer) of any shape.
    Synth(synth::Args),
    /// Prompt and generation throughput at depths, in process (llama-bench style names).
    Bench(bench::Args),
    /// Prompt and generation throughput of an OpenAI-compatible server, as a user sees it.
    BenchHttp(bench_http::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Inspect(a) => inspect::main(a),
        Cmd::Tokenize(a) => tokenize::tokenize(a),
        Cmd::Detokenize(a) => tokenize::detokenize(a),
        Cmd::Logits(a) => logits::main(a),
        Cmd::Run(a) => run::main(a),
        Cmd::Serve(a) => serve::main(a),
        Cmd::Synth(a) => synth::main(a),
        Cmd::Bench(a) => bench::main(a),
        Cmd::BenchHttp(a) => bench_http::main(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
