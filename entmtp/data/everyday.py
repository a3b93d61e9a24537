"""Everyday single-turn requests: the second chat evaluation set, and training instructions.

Evaluation (`data/everyday/eval.jsonl`): 72 short requests written for this project (CC0, see
`data/everyday/README.md`), eight kinds of nine: advice, explanation, creative, howto, rewriting,
lists, smalltalk, messages. Never trained or calibrated on.

Training and calibration: instructions composed from the templates and subjects below (also
written for this project), in a fixed seeded order; every 10th is `calib`, the rest `train`. Any
composed instruction that is an evaluation prompt or shares a word 4-gram with one is dropped
(`overlaps`), so the two can never meet; tests check it against every evaluation set.
"""

from __future__ import annotations

import functools
import json
import random
import re

from entmtp.config import ROOT
from entmtp.data.errors import DataError

EVAL_FILE = ROOT / "data" / "everyday" / "eval.jsonl"
KINDS = ("advice", "explanation", "creative", "howto", "rewriting", "lists", "smalltalk", "messages")
SEED = 0
CALIB_EVERY = 10  # every 10th composed instruction calibrates
NGRAM = 4  # shared word n-grams that make a composed instruction too close to an evaluation prompt

# kind -> (templates with one {x}, subjects)
TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "advice": (
        ("What are your best tips for {x}?", "I'm struggling with {x}. Any advice?", "How can I get better at {x}?",
         "Give me some practical advice about {x}.", "What mistakes should I avoid when {x}?",
         "Any suggestions for {x} on a tight schedule?", "My friend asked me about {x}. What should I tell her?"),
        ("learning a new language", "keeping a tidy apartment", "sleeping better", "talking to my boss about a raise",
         "studying for exams", "cooking for one person", "staying motivated at the gym", "planning a road trip",
         "dealing with a noisy neighbor", "reading more books", "drinking more water", "learning to play guitar",
         "managing stress at work", "buying a used car", "taking care of a puppy", "speaking in public",
         "choosing a laptop", "writing a cover letter", "getting organized", "eating less sugar",
         "keeping in touch with old friends", "starting a side project", "traveling with kids", "working night shifts",
         "learning to swim as an adult", "being more patient", "preparing for a first date", "moving house",
         "caring for an elderly parent", "planning a wedding on a budget", "training for a 5k race", "quitting social media"),
    ),
    "explanation": (
        ("Explain {x} in simple terms.", "What is {x}?", "Can you explain {x} to a beginner?",
         "How does {x} work?", "Give me a short explanation of {x}.", "Why does {x} matter?",
         "Describe {x} in a few sentences."),
        ("photosynthesis", "compound interest", "the water cycle", "gravity", "a credit score", "the internet",
         "democracy", "an earthquake", "a rainbow", "the stock market", "recycling", "electricity", "a solar eclipse",
         "the greenhouse effect", "machine learning", "a blockchain", "the immune system", "tides", "a mortgage",
         "evolution", "time zones", "a thunderstorm", "the placebo effect", "supply and demand", "a microwave oven",
         "jet lag", "a password manager", "the seasons", "a volcano", "antibiotics", "a cloud server", "taxes"),
    ),
    "creative": (
        ("Write a short poem about {x}.", "Write a haiku about {x}.", "Tell me a short story about {x}.",
         "Write a limerick about {x}.", "Write a few lines of song lyrics about {x}.",
         "Describe {x} in a vivid paragraph.", "Write a tiny fairy tale about {x}."),
        ("the ocean at night", "a lost umbrella", "autumn leaves", "a robot learning to paint", "a city in the rain",
         "a grandmother's kitchen", "the last day of summer", "a dog waiting at the door", "a mountain sunrise",
         "an old train station", "a lonely astronaut", "a garden in spring", "a clumsy knight", "the full moon",
         "a secret library", "a snowman who wants to travel", "a busy bakery", "a paper boat", "friendship",
         "a thunderstorm over the fields", "a talking parrot", "a forgotten toy", "a firefly", "homesickness",
         "the first day of school", "a pirate who is afraid of water", "a quiet forest", "a broken clock"),
    ),
    "howto": (
        ("How do I {x}?", "What are the steps to {x}?", "Explain how to {x}.", "Give me a simple guide to {x}.",
         "What's the easiest way to {x}?", "Walk me through how to {x}."),
        ("make pancakes", "bake banana bread", "write a resume", "plant tomatoes", "hang a picture frame",
         "unclog a drain", "make cold brew coffee", "start journaling", "meditate for ten minutes",
         "wash a wool sweater", "fold a fitted sheet", "make a paper airplane", "change a car's oil",
         "cook rice on the stove", "create a strong password", "learn to juggle", "make a smoothie",
         "paint a room", "back up my phone", "make a weekly meal plan", "sharpen a kitchen knife",
         "write a thank-you card", "prepare for a job fair", "clean a laptop keyboard", "grow herbs indoors",
         "make homemade pizza dough", "set up a fish tank", "organize a closet", "take better photos with my phone",
         "brew green tea properly"),
    ),
    "rewriting": (
        ("Rewrite this to sound more polite: {x}", "Make this more formal: {x}", "Fix the grammar: {x}",
         "Rewrite this in simple words: {x}", "Make this sound friendlier: {x}", "Shorten this sentence: {x}",
         "Paraphrase this: {x}"),
        ("Give me the file by tonight.", "i dont know where the keys is", "We regret to inform you that your application was unsuccessful.",
         "The train was late so I missed the beginning of the movie.", "you forgot to call me back again",
         "Please be advised that the office will be closed on Monday.", "He don't like vegetables very much.",
         "The product launch has been delayed due to unforeseen circumstances.", "Stop making so much noise.",
         "I am writing to complain about the service I received.", "We need more people to help with the event.",
         "Their going to the park after lunch.", "The results of the survey were not what we expected.",
         "Can you fix my computer, it is broken.", "Our team finished the project two days early.",
         "The weather is bad so the picnic is off.", "I has finished my homework already.",
         "Customers must present a receipt for all returns.", "This is the worst coffee I have ever had.",
         "Let me know if you have any questions.", "The meeting went on for too long and nothing was decided."),
    ),
    "lists": (
        ("List five {x}.", "Give me a list of {x}.", "Name some {x}.", "What are some {x}?",
         "Suggest ten {x}.", "Make a short list of {x}."),
        ("ideas for a birthday gift", "easy dinner recipes", "hobbies to try this year", "famous painters",
         "ways to relax after work", "places to visit in Europe", "tips for a long flight", "fruits high in vitamin C",
         "movies for a family evening", "outdoor activities for kids", "things to bring to a picnic",
         "podcast topics", "names for a golden retriever", "habits of successful students", "ways to be more productive",
         "questions to ask a new friend", "cheap date ideas", "things to do in winter", "ways to save electricity",
         "vegetables that grow fast", "icebreaker games for a team", "skills worth learning", "kinds of exercise you can do at home",
         "songs for a road trip", "breakfast ideas without eggs", "ways to celebrate a friend's success"),
    ),
    "smalltalk": (
        ("{x}",),
        ("Hello there!", "Hey, what's up?", "How was your day?", "I just got a new puppy!", "It's raining again here.",
         "Do you like music?", "What's your favorite food?", "I passed my driving test today!", "Can you tell me a riddle?",
         "Tell me something that will make me smile.", "What do you think about cats?", "I can't sleep.",
         "Tell me a fun fact about space.", "Do you prefer the beach or the mountains?", "I'm learning to cook!",
         "What's a good movie to watch tonight?", "Thanks for your help earlier!", "Tell me a joke.",
         "I'm feeling a bit down today.", "Happy Friday!", "What should I have for lunch?", "Tell me a fun fact about bees.",
         "Is it better to have a cat or a dog?", "I just finished reading a great book.", "Say something nice.",
         "What's the best thing about summer?", "Good night!", "Tell me about your favorite animal."),
    ),
    "messages": (
        ("Write a short message to {x}.", "Write an email to {x}.", "Help me write a note to {x}.",
         "Draft a quick text to {x}.", "Write a polite message to {x}."),
        ("thank my teacher at the end of the year", "my team about a new project deadline", "a client apologizing for a late delivery",
         "my friend wishing her luck on her exam", "my manager asking for a day off", "a neighbor about a party next weekend",
         "my sister congratulating her on the new baby", "a shop asking about a refund", "my coach saying I will miss practice",
         "a new coworker welcoming him to the team", "my doctor's office to reschedule an appointment",
         "a friend I haven't talked to in years", "my parents telling them I got the job", "a hotel asking for a late check-out",
         "the school about my son's absence", "a volunteer group thanking them for their help", "a seller asking if the bike is still available",
         "my roommate about cleaning the kitchen", "a colleague asking for feedback on my draft", "guests confirming the dinner time"),
    ),
}


# a second set, composed after the first (its seeded order and splits stay as they were)
MORE_TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "advice": (
        ("How do people usually handle {x}?", "I want to start {x}. Where do I begin?", "Is there a smart way to approach {x}?",
         "What should a beginner know about {x}?", "Can you give me three tips for {x}?"),
        ("saving money for a holiday", "waking up early", "making friends in a new city", "keeping houseplants alive",
         "negotiating the price of a car", "writing a wedding speech", "staying focused while working from home",
         "getting back into running after an injury", "teaching a child to ride a bike", "handling a difficult coworker",
         "preparing for a long hike", "eating healthy on a budget", "learning to draw", "going back to school at forty",
         "asking for feedback", "saying no without feeling guilty", "hosting a dinner party", "choosing a good book for a teenager",
         "keeping a journal", "fixing a bad sleep schedule", "taking notes in class", "planning a surprise party",
         "decluttering a garage", "choosing a first pet", "staying calm before an interview"),
    ),
    "explanation": (
        ("What's the difference between {x}?", "In plain English, what does {x} mean?", "Help me understand {x}.",
         "Teach me the basics of {x}.", "Why do people talk so much about {x}?"),
        ("a virus and bacteria", "weather and climate", "inflation", "a black hole", "a budget and a forecast",
         "how vaccines train the body", "interest rates", "why the sky is blue", "how bees make honey", "the moon's phases",
         "how a bill becomes a law", "a hybrid car", "renewable energy", "what a calorie is", "the metric system",
         "how airplanes stay in the air", "a 401(k) plan", "nuclear energy", "the food chain", "how memory works",
         "why leaves change color", "the speed of light", "a heat pump", "how a camera works", "the ozone layer"),
    ),
    "creative": (
        ("Write a four-line poem about {x}.", "Tell me a bedtime story about {x}.", "Write a funny short story about {x}.",
         "Write a short diary entry from the point of view of {x}.", "Write a rhyming verse about {x}."),
        ("a cat who runs a cafe", "a river in winter", "the smell of fresh bread", "a kite on a windy day",
         "a lighthouse keeper", "a dragon who loves books", "an empty playground", "the first snow of the year",
         "a street musician", "a tiny house in the woods", "a shy giraffe", "a spaceship made of cardboard",
         "a lazy Sunday morning", "a letter that was never sent", "a sunflower field", "an old wooden bridge",
         "a squirrel planning a heist", "the sound of rain on a tin roof", "a night market", "a child's first kite",
         "an owl who cannot sleep", "a family road trip", "a kind stranger", "a clock tower", "a rainy afternoon"),
    ),
    "howto": (
        ("I've never done this before: how do I {x}?", "What do I need to {x}?", "Quick question: how can I {x}?",
         "Could you explain, step by step, how to {x}?", "What's a good way to {x}?"),
        ("boil an egg", "make a budget spreadsheet", "tie a tie", "remove a coffee stain", "set up a home Wi-Fi network",
         "write a short speech", "plan a picnic", "start a vegetable garden", "make iced tea", "patch a bike tire",
         "clean a cast iron pan", "pack a suitcase efficiently", "make guacamole", "write a haiku", "teach a dog to sit",
         "make a simple website", "iron a shirt", "defrost a freezer", "make lemonade", "start a book club",
         "train for a marathon", "study for a math test", "keep cut flowers fresh", "make a photo album", "roast vegetables"),
    ),
    "rewriting": (
        ("Make this sound more professional: {x}", "Rewrite this so a child can understand it: {x}", "Correct the spelling and grammar: {x}",
         "Make this more concise: {x}", "Rewrite this with a positive tone: {x}"),
        ("me and him goes to the store every day", "The deadline cannot be moved under any circumstances.",
         "I think maybe we could possibly try to meet sometime next week if that works.", "your package is late becuase of the weather",
         "We was very happy with the hotel.", "Nobody told me the meeting was cancelled.", "The software is not working and I am angry.",
         "Please refrain from eating in the laboratory.", "It is what it is, we lost the game.", "Can u send me the report asap",
         "The new policy will affect all employees starting next month.", "She don't want to come to the party.",
         "I never got a reply to my last three emails.", "Parking is prohibited in front of the building.",
         "The food was cold and the waiter was rude.", "Thank you for your patience during the renovation.",
         "We are unable to process your request at this time.", "The kids was playing outside all day.",
         "Sorry for the late reply, I was busy.", "Our sales went down a lot this quarter."),
    ),
    "lists": (
        ("Can you list some {x}?", "Brainstorm a few {x}.", "Give me seven {x}.", "I need some {x}. Any ideas?",
         "Write a bullet list of {x}."),
        ("board games for two players", "healthy snacks for work", "ways to make new friends", "rainy day activities",
         "classic novels everyone should read", "gift ideas for a teacher", "ways to reduce plastic waste",
         "things to pack for a beach holiday", "easy houseplants", "team names for a trivia night", "quick stretches for the office",
         "fun science experiments for kids", "ways to say thank you", "budget travel tips", "topics for a school essay",
         "things to do on a lazy weekend", "ideas for a small garden", "good habits to start in the morning",
         "interview questions to prepare for", "ways to learn new words", "dinner ideas with chicken", "summer camp activities",
         "things to check before a long drive", "ideas for a themed party", "ways to cheer up a friend"),
    ),
    "smalltalk": (
        ("{x}",),
        ("Good morning!", "I'm so tired today.", "What's your favorite season?", "I just started a new job!",
         "Do you have any hobbies?", "It's my birthday today!", "Tell me a fun fact about the ocean.", "I'm bored.",
         "What do you like to do on weekends?", "Can you recommend a song?", "I finally cleaned my room!",
         "Do you like coffee or tea better?", "Tell me a short joke about computers.", "I'm nervous about tomorrow.",
         "What's a good name for a goldfish?", "I'm going on vacation next week!", "Tell me a fun fact about octopuses.",
         "What's your favorite color?", "I made soup for the first time!", "Any plans for the weekend?",
         "Tell me something interesting.", "I lost my keys again.", "How are you today?", "What's a good book to read?"),
    ),
    "messages": (
        ("Can you write a message to {x}?", "Write a friendly email to {x}.", "Write a short, polite text to {x}.",
         "Help me word a message to {x}.", "Compose a brief note to {x}."),
        ("my landlord about a broken heater", "a coworker thanking her for covering my shift", "my son's teacher asking for a meeting",
         "a friend inviting him to my birthday", "a customer thanking them for their order", "my team celebrating a finished project",
         "a recruiter declining a job offer", "my neighbor thanking him for watering my plants", "a restaurant booking a table for six",
         "my grandmother wishing her a happy birthday", "a club asking how to join", "my boss explaining I'm sick today",
         "a friend apologizing for missing her party", "the gym cancelling my membership", "a new client introducing myself",
         "my classmates about our group project", "a plumber asking for a quote", "my aunt thanking her for the gift",
         "a colleague congratulating him on his promotion", "the bank asking about a strange charge"),
    ),
}

# a third set, composed after the second (the earlier instructions keep their places and splits)
THIRD_TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "advice": (
        ("What would you do about {x}?", "I could use some help with {x}.", "Which habits help with {x}?",
         "How should I think about {x}?", "Share a few pointers on {x}.", "What is the first step in {x}?"),
        ("finding a good dentist", "paying off a credit card", "writing thank-you notes", "keeping a bike in good shape",
         "getting a toddler to eat vegetables", "choosing a running shoe", "sharing a kitchen with roommates",
         "returning to work after parental leave", "picking a college major", "living with a partner for the first time",
         "asking a neighbor to turn the music down", "making a long flight comfortable", "organizing family photos",
         "keeping a car clean", "learning to cook rice properly", "cutting down on coffee", "saving for a first home",
         "staying warm in a drafty house", "preparing a child for a new school", "lending money to a friend",
         "writing a complaint letter", "getting through a long winter", "meeting a partner's parents", "renting a first apartment",
         "dealing with a breakup", "keeping a garden free of weeds", "choosing a gym", "planning meals for the week"),
    ),
    "explanation": (
        ("Could you break down {x} for me?", "What should everyone know about {x}?", "Explain {x} like I'm twelve.",
         "Tell me how {x} works, briefly.", "What's the main idea behind {x}?", "Summarize {x} in one paragraph."),
        ("a power grid", "the water table", "a trade deficit", "a hurricane", "a search engine", "composting",
         "a pension", "the human heart", "an election primary", "erosion", "how a refrigerator keeps food cold",
         "a leap year", "a cover letter's purpose", "dark matter", "a spreadsheet formula", "how soap cleans",
         "the Richter scale", "a minimum wage", "how a compass works", "bird migration", "a credit union",
         "the northern lights", "how noise-cancelling headphones work", "an allergy", "a wind turbine", "a coral reef",
         "how a thermostat works", "a tax refund"),
    ),
    "creative": (
        ("Write a short scene about {x}.", "Write a two-stanza poem about {x}.", "Write a fable about {x}.",
         "Write a very short mystery about {x}.", "Write a cheerful poem about {x}.", "Write a sad little story about {x}."),
        ("a forgotten birthday", "a snowman who wants to travel", "a bakery at dawn", "a penguin in the desert",
         "two old friends meeting again", "a broken music box", "a farmer and a storm", "a library after closing time",
         "a paper boat", "a mouse who wants to sing", "a secret garden door", "a bus driver's last shift",
         "a homesick alien", "an unexpected letter", "a village festival", "a runaway balloon", "a fox and a crow",
         "the last leaf on a tree", "a night train to the sea", "a grumpy cloud", "a goldfish's big dream",
         "a lighthouse in the fog", "a pair of lost mittens", "a city pigeon", "an old photograph", "a sleepy volcano",
         "a baker who cannot smell", "a tortoise on holiday"),
    ),
    "howto": (
        ("Walk me through how to {x}.", "What's the easiest way to {x}?", "I'd like to {x}. What are the steps?",
         "Can you teach me to {x}?", "Give me simple instructions to {x}.", "How long does it take to {x}, and how do I do it?"),
        ("hang a picture frame", "bake banana bread", "change a flat tire", "unclog a sink", "sew a button",
         "brew coffee with a French press", "back up my phone", "fold a fitted sheet", "paint a room", "make pancakes",
         "clean a laptop keyboard", "plant a tree", "write a resume", "make a paper airplane", "descale a kettle",
         "grow herbs on a windowsill", "cook pasta al dente", "wash a wool sweater", "set a table for guests",
         "make a smoothie", "start composting at home", "build a campfire safely", "polish leather shoes", "make popcorn on the stove",
         "wrap a present neatly", "learn to juggle", "make a grocery list that works", "clean windows without streaks"),
    ),
    "rewriting": (
        ("Rewrite this to sound friendlier: {x}", "Make this clearer: {x}", "Fix the grammar in this sentence: {x}",
         "Turn this into a polite request: {x}", "Shorten this: {x}", "Rewrite this in a formal tone: {x}"),
        ("i cant come tomorow sorry", "The printer is broken again and nobody fixed it.", "Send me the files.",
         "We regret to inform you that your application was unsuccessful.", "He have three brothers and one sister.",
         "Stop leaving dishes in the sink.", "The meeting went long and we didn't decide anything.",
         "Your account will be closed if you do not pay.", "me and my friends was at the beach", "Turn the music down.",
         "The product arrived damaged and late.", "Its to cold to go outside today.", "I need the money back now.",
         "We are happy to announce our new store opening.", "They wasn't ready for the test.", "Give me a call when you can.",
         "The train is delayed by two hours due to repairs.", "Nobody answered the phone at the office.",
         "I have went to that museum before.", "You forgot to sign the form again.", "The bill is due on Friday.",
         "Our team didn't hit the target this month.", "Can you help me move on Saturday", "the park close at 8 pm"),
    ),
    "lists": (
        ("What are some {x}?", "List ten {x}.", "Suggest a handful of {x}.", "Give me a short list of {x}.",
         "Name five {x}.", "Help me come up with {x}."),
        ("things to do in a small town", "ways to save energy at home", "breakfast ideas without eggs", "hobbies for retired people",
         "questions to ask a new doctor", "ways to celebrate a coworker's birthday", "podcast topics", "indoor games for kids",
         "names for a bakery", "ways to relax after work", "foods that keep well in the freezer", "reasons to learn to cook",
         "cheap date ideas", "things to bring to a potluck", "ways to stay cool in summer", "family movie night snacks",
         "tips for a tidy desk", "things to write in a birthday card", "ways to make a commute more pleasant",
         "plants that attract butterflies", "questions for a job interview", "weekend projects for a garage",
         "ways to stay in touch with family abroad", "ideas for a class field trip", "soups for a cold day", "ways to practice gratitude"),
    ),
    "smalltalk": (
        ("{x}",),
        ("Hi there!", "I can't decide what to eat for dinner.", "It's raining again.", "I adopted a kitten!",
         "Do you ever get bored?", "Guess what, I passed my driving test!", "Tell me a fun fact about space.",
         "I'm having a lazy day.", "What's your favorite animal?", "I burned my toast this morning.",
         "Say something nice.", "Tell me a riddle.", "I just finished a really long book.", "It's so hot today.",
         "I'm learning to knit.", "What should I watch tonight?", "My team won the match!", "Tell me a fun fact about bees.",
         "I'm thinking about getting a haircut.", "Good night!", "I'm excited for the weekend.", "I miss my friends.",
         "Tell me a tongue twister.", "What's the best pizza topping?"),
    ),
    "messages": (
        ("Write a short message to {x}.", "Draft an email to {x}.", "Write a kind note to {x}.",
         "Help me write a text to {x}.", "Write a polite reminder to {x}.", "Write a brief apology to {x}."),
        ("my neighbor about a package I received by mistake", "a friend who just had a baby", "my coach saying I'll miss practice",
         "a hotel asking about late check-in", "my manager requesting a day off", "a teacher thanking her for a great year",
         "a friend who is moving away", "the library about an overdue book", "a new neighbor welcoming them",
         "a client about a delayed delivery", "my cousin congratulating her on graduating", "a shop asking if an item is in stock",
         "my roommate about the electricity bill", "a volunteer group offering to help", "a doctor's office to reschedule",
         "an old teacher to say thanks", "my brother wishing him luck on his exam", "a colleague welcoming her back from leave",
         "a landlord asking to paint the walls", "a friend asking to borrow a ladder", "my team about Friday's lunch",
         "a seller asking about a used bike", "my parents about holiday plans", "a mentor asking for advice"),
    ),
}


def _norm(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = _norm(text)
    return {tuple(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}


def overlaps(text: str, others: set[tuple[str, ...]]) -> bool:
    """Whether `text` shares a word n-gram with `others` (the n-grams of the evaluation prompts)."""
    return bool(_ngrams(text) & others)


@functools.lru_cache(maxsize=1)
def eval_rows() -> tuple[dict, ...]:
    """The evaluation set: {"prompt", "task": "chat", "kind"} per line, in file order."""
    if not EVAL_FILE.is_file():
        raise DataError(f"everyday evaluation set not found: {EVAL_FILE}")
    rows = []
    for lineno, line in enumerate(EVAL_FILE.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                rows.append({"prompt": str(row["prompt"]), "task": "chat", "kind": str(row["kind"])})
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{EVAL_FILE}: line {lineno}: bad record ({e})") from None
    return tuple(rows)


def eval_ngrams() -> set[tuple[str, ...]]:
    return set().union(*(_ngrams(r["prompt"]) for r in eval_rows()))


@functools.lru_cache(maxsize=1)
def composed() -> tuple[tuple[str, str], ...]:
    """(kind, instruction) for every template and subject, evaluation overlaps dropped: the first set
    in its seeded order, then the second (`MORE_TEMPLATES`) and the third (`THIRD_TEMPLATES`) each in
    its own, so that adding a set kept every earlier instruction's place and split."""
    banned, out = eval_ngrams(), []
    for seed, templates in ((SEED, TEMPLATES), (SEED + 1, MORE_TEMPLATES), (SEED + 2, THIRD_TEMPLATES)):
        rows = [(kind, t.format(x=x)) for kind, (ts, subjects) in templates.items() for t in ts for x in subjects]
        random.Random(seed).shuffle(rows)
        if templates is THIRD_TEMPLATES:  # an instruction an earlier set composed is not composed again
            seen = {text for _, text in out}
            rows = [r for r in rows if not (r[1] in seen or seen.add(r[1]))]
        out += [r for r in rows if not overlaps(r[1], banned)]
    return tuple(out)


def prompts(split: str) -> list[str]:
    """Composed instructions of `split` ("train" or "calib"; evaluation prompts are `eval_rows`)."""
    if split == "eval":
        return [r["prompt"] for r in eval_rows()]
    want_calib = split == "calib"
    return [p for i, (_, p) in enumerate(composed()) if (i % CALIB_EVERY == CALIB_EVERY - 1) == want_calib]
