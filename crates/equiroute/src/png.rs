//! PNG copies of the laboratory's SVG plots, rendered with resvg and the system's fonts.
//! Where the machine has no fonts, the PNG still shows the plot but no text.

use anyhow::Context;
use resvg::{tiny_skia, usvg};
use std::sync::OnceLock;

/// Fonts are loaded once per process: scanning the system fonts takes tens of milliseconds.
fn options() -> &'static usvg::Options<'static> {
    static OPTIONS: OnceLock<usvg::Options<'static>> = OnceLock::new();
    OPTIONS.get_or_init(|| {
        let mut opt = usvg::Options::default();
        let db = opt.fontdb_mut();
        db.load_system_fonts();
        // `sans-serif` resolves to Arial by default, rarely installed on servers: map it to a
        // sans face that is (DejaVu Sans where present, else any).
        let families: Vec<String> = db
            .faces()
            .flat_map(|f| f.families.iter().map(|(name, _)| name.clone()))
            .collect();
        let sans = families
            .iter()
            .find(|n| n.as_str() == "DejaVu Sans")
            .or_else(|| {
                families
                    .iter()
                    .find(|n| n.contains("Sans") && !n.contains("Mono"))
            })
            .or_else(|| families.first())
            .cloned();
        if let Some(family) = sans {
            db.set_sans_serif_family(family.clone());
            opt.font_family = family;
        }
        opt
    })
}

/// Renders an SVG document to PNG bytes.
pub fn render(svg: &str) -> anyhow::Result<Vec<u8>> {
    let tree = usvg::Tree::from_str(svg, options()).context("the plot is not valid SVG")?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .context("the plot has an empty size")?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.encode_png().context("PNG encoding failed")
}
