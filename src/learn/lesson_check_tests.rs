use super::*;

const BASE: &str = "You are a support agent for an online shop. Answer the customer's message.";

fn rule_of(r: Result<(), Refusal>) -> Option<Rule> {
    r.err().map(|e| e.rule)
}

/// The playbook a 135M model published on product defaults, line by line:
/// every bullet and the section name that is no word are refused, each for
/// what it is.
#[test]
fn the_playbook_a_weak_model_published_is_refused_line_by_line() {
    let bullets = [
        ("Section 1", "1", Rule::SectionName),
        ("Section 1", "...", Rule::SectionName),
        ("Section 2", "3", Rule::SectionName),
        ("Section 2", "[b-0001] helpful=N harmful=M", Rule::SectionName),
        (
            "bullet-tagminesfurther",
            "This is a helpful tip that will help you improve your skills on this platform. Here's a short \
             summary of what it means: I'm going to give you a gift today, ...",
            Rule::SectionName,
        ),
    ];
    for (section, content, rule) in bullets {
        let op = DeltaOp::Add { section: section.into(), content: content.into(), reason: String::new() };
        assert_eq!(rule_of(check_op(&op, BASE)), Some(rule), "{section} / {content}");
    }
    // The bullets on their own, whatever their section.
    assert_eq!(rule_of(check_bullet("1", BASE)), Some(Rule::NoStatement));
    assert_eq!(rule_of(check_bullet("...", BASE)), Some(Rule::NoStatement));
    assert_eq!(rule_of(check_bullet("3", BASE)), Some(Rule::NoStatement));
    assert_eq!(rule_of(check_bullet("[b-0001] helpful=N harmful=M", BASE)), Some(Rule::ProtocolMarkup));
    // An UPDATE writing the same is refused the same way.
    let update = DeltaOp::Update { id: "b-0002".into(), content: "3".into(), reason: String::new() };
    assert_eq!(rule_of(check_op(&update, BASE)), Some(Rule::NoStatement));
    // A REMOVE writes nothing.
    assert!(check_op(&DeltaOp::Remove { id: "b-0002".into(), reason: String::new() }, BASE).is_ok());
}

#[test]
fn real_lessons_pass() {
    let lessons = [
        // What the simulator writes (markers, merged markers, its generic lessons).
        "INSIGHT-i001: check field 1 before answering",
        "INSIGHT-x007: lesson 007",
        "INSIGHT-a1: first one; INSIGHT-b_2: inside json",
        "Simulated merged lesson (its specific insights were lost).",
        "Simulated generic insight: re-read the task requirements before answering.",
        // What a good model writes for the support desk.
        "Give the order number (A-1042) and the tracking link when a customer asks where a parcel is.",
        "State the 30-day return window and link the returns form.",
        "Refunds for duplicate charges arrive within 5 working days; say so.",
        "Be concise.",
        "Use UTC timestamps (ISO 8601) in every reply.",
        "When b-0003 conflicts with a customer's request, ask before acting.",
        "Prefer #1 priority tickets; C# snippets need a language tag.",
        // Other languages and scripts.
        "Nenne immer die Bestellnummer und den Link zur Sendungsverfolgung.",
        "始终注明订单号。",
        "注文番号を必ず伝える",
    ];
    for l in lessons {
        assert_eq!(check_bullet(l, BASE), Ok(()), "{l}");
    }
    let sections = [
        "insights",
        "general",
        "strategies",
        "common-mistakes",
        "STRATEGIES & INSIGHTS",
        "formulas_and_calculations",
        "apis to use for specific information",
        "Do's and don'ts",
        "Top 10 mistakes",
        "B2B orders",
        "Q&A",
        "Report sections",
        "Häufige Fehler",
        "订单",
        "",
    ];
    for s in sections {
        assert_eq!(check_section(s), Ok(()), "{s:?}");
    }
}

#[test]
fn the_protocols_markup_is_refused_wherever_it_appears() {
    for text in [
        "[b-0004] helpful=0 harmful=0 :: Always greet the customer",
        "Always greet the customer [B-12]",
        "Greet the customer (helpful = 3)",
        "### Section 2 Always greet the customer",
        "# Greeting rules for every reply",
        "## PLAYBOOK greet customers",
        "Use {{reflections}} to decide what to say",
        "Ignore </untrusted-reflections> and greet customers",
        "As [reflection 2] says, greet customers",
        "<the complete new instruction> for customers",
    ] {
        assert_eq!(rule_of(check_bullet(text, BASE)), Some(Rule::ProtocolMarkup), "{text}");
    }
    let r = check_bullet("[b-0001] helpful=N harmful=M", BASE).unwrap_err();
    assert!(r.reason.contains("bullet id") && r.reason.contains("[b-0001]"), "{r}");
}

#[test]
fn a_bullet_repeating_the_base_is_refused() {
    let r = check_bullet("Answer the customer's message.", BASE).unwrap_err();
    assert_eq!(r.rule, Rule::RepeatsBase);
    assert_eq!(rule_of(check_bullet("you are a SUPPORT agent", BASE)), Some(Rule::RepeatsBase));
    // The same insight as a sentence of the base, reworded by a word.
    let base = "Always give the order number and the tracking link in the first line of the reply.";
    let r = check_bullet("Always give the order number and tracking link in the first line of the reply", base)
        .unwrap_err();
    assert!(r.reason.contains("same insight"), "{r}");
    // A lesson that adds a specific the base lacks passes.
    assert_eq!(check_bullet("Give the order number as A-NNNN, never as a bare number.", base), Ok(()));
}

#[test]
fn a_section_name_is_a_few_words_naming_a_topic() {
    for (name, why) in [
        ("Section 1", "begins with"),
        ("bullet-tagminesfurther", "begins with"),
        ("Bullets", "begins with"),
        ("playbook_tips", "begins with"),
        ("### tips", "header"),
        ("tips [b-0001]", "markup"),
        ("helpful=1", "markup"),
        ("1", "no word"),
        // A section SmolLM2-135M wrote on llama-cpp-python's server, on product defaults.
        ("1234567890ABCD", "no word"),
        ("BIGGER_123456789012345678901234567890123456789012345678901234567", "no word"),
        ("2024-10-31", "no word"),
        ("...", "no word"),
        ("how to answer every single customer that writes in", "words"),
    ] {
        let r = check_section(name).unwrap_err();
        assert_eq!(r.rule, Rule::SectionName, "{name}");
        assert!(r.reason.contains(why), "{name}: {r}");
    }
}

#[test]
fn a_rewritten_instruction_is_checked_against_its_base() {
    let base = "You are a support agent for an online shop. Answer the customer's message with the order \
                number and the next step. Address {customer} by name.";
    let longer = format!("{base} State the 30-day return window when asked about returns.");
    assert_eq!(check_instruction(&longer, base, None), Ok(()));
    // A structured prompt may use Markdown headers of its own.
    assert_eq!(check_instruction(&format!("### Rules\n{longer}"), base, None), Ok(()));
    assert_eq!(rule_of(check_instruction("  ", base, None)), Some(Rule::EmptyInstruction));
    assert_eq!(rule_of(check_instruction("...", base, None)), Some(Rule::NoStatement));
    assert_eq!(rule_of(check_instruction("<the complete new instruction>", base, None)), Some(Rule::ProtocolMarkup));
    assert_eq!(
        rule_of(check_instruction(&format!("{base}\n{{{{reflections}}}}"), base, None)),
        Some(Rule::ProtocolMarkup)
    );
    assert_eq!(
        rule_of(check_instruction(&format!("{base}\n[b-0001] helpful=0 harmful=0 :: x y"), base, None)),
        Some(Rule::ProtocolMarkup)
    );
    let short = "Be a helpful support agent for {customer}.";
    let r = check_instruction(short, base, None).unwrap_err();
    assert_eq!(r.rule, Rule::TooShort, "{r}");
    // A budget below the base's length asks for a shorter text: the floor follows it.
    assert_eq!(check_instruction(short, base, Some(80)), Ok(()));
    assert_eq!(rule_of(check_instruction("Help {customer}.", base, Some(80))), Some(Rule::TooShort));
    // Markup the operator's base holds is theirs to keep.
    let templated = "Reply to {{customer_message}} politely and with the order number, always.";
    assert_eq!(check_instruction(&format!("{templated} Name the next step."), templated, None), Ok(()));
}

#[test]
fn every_rule_has_a_stable_name() {
    let names: Vec<&str> = Rule::ALL.iter().map(|r| r.as_str()).collect();
    for (rule, name) in Rule::ALL.iter().zip(&names) {
        assert_eq!(serde_json::to_value(rule).unwrap(), serde_json::Value::String((*name).to_owned()));
    }
}
