//! Sources of quality feedback other than the API: the LLM-as-judge, which scores a sample
//! of answers beside the request path (a bounded number of judge calls at once, anything
//! beyond skipped; a judge failure never touches the request it was judging). Scores from
//! any source end in the server's `feedback::apply`.

pub mod judge;
