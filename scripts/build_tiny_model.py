"""Build the tiny model directory that `openengine-mock` and the Dynamo frontend load (no weights, no downloads).

Writes, into ``sidecar/testing/mock/model/`` by default:

* ``corpus.txt``: original English prose, one sentence per line, blank lines between topics. The hand-written sentences
  and the seeded templates below are this project's own text (no third-party text).
* ``tokenizer.json``: a byte-level BPE trained on the corpus with ``tokenizers``.
* ``tokenizer_config.json``, ``config.json``, ``generation_config.json``: the Hugging Face metadata the frontend reads.

Deterministic: the same ``tokenizers`` version writes byte-identical files on every run (``tests/mock/test_lm.py``
checks that the committed directory equals a fresh build). Re-run after changing anything here::

    python scripts/build_tiny_model.py            # or: --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MODEL_DIR = Path(__file__).resolve().parent.parent / "sidecar" / "testing" / "mock" / "model"

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")  # ids 0..4
BOS, EOS, UNK, IM_START, IM_END = SPECIAL_TOKENS
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048
SEED = 20250101
TEMPLATE_SENTENCES_PER_TOPIC = 36

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# ---------------------------------------------------------------------------------------------------------------------
# The corpus. Each topic has hand-written sentences and a template: subjects x predicates x optional endings, chosen so
# that every combination is a sensible sentence. Sentences end with a full stop and contain no other full stop (the
# text model treats a sentence end as the place where a generation may stop).
# ---------------------------------------------------------------------------------------------------------------------

_Topic = tuple[str, list[str], list[str], list[str], list[str]]  # name, hand-written, subjects, predicates, endings

# fmt: off
TOPICS: list[_Topic] = [
    (
        "weather",
        [
            "The morning was grey and still, and the smoke rose straight up from every chimney.",
            "By noon the clouds had broken apart and the fields were bright with sun.",
            "A warm wind came up from the south and dried the roads in an hour.",
            "Thunder rolled over the hills long before the first drops of rain fell.",
            "The forecast promised a clear night, so the farmers covered their young plants against the frost.",
            "Snow fell quietly through the night and buried the fences up to their rails.",
            "In late summer the air grows heavy, and storms gather over the valley almost every evening.",
            "Fog lay so thick along the shore that the lighthouse sounded its horn until midday.",
            "After the rain the streets smelled of wet stone and cut grass.",
            "The barometer in the hall fell steadily all afternoon.",
            "A rainbow stood over the orchard for a few minutes and then faded.",
            "Hail rattled on the tin roof of the shed like a handful of thrown gravel.",
            "The wind changed direction twice before sunset.",
            "On the coldest mornings the puddles froze into thin sheets of glass.",
        ],
        [
            "The wind", "A cold rain", "The morning fog", "A light snow", "The summer heat", "A sudden storm",
            "The evening breeze", "A thin drizzle", "The first frost", "A band of dark cloud", "The autumn gale",
            "A soft mist",
        ],
        [
            "drifted over the hills", "settled over the town", "swept across the open fields",
            "lingered in the low valleys", "moved slowly toward the coast", "came down from the north",
            "covered the gardens", "passed over the harbor", "arrived from the sea", "reached the mountains",
            "spread along the valley", "hid the far side of the lake",
        ],
        [
            "before dawn", "in the late afternoon", "for most of the day", "during the night", "without warning",
            "as the church bell rang", "while the market was still open", "soon after breakfast",
        ],
    ),
    (
        "rivers",
        [
            "The river begins as a spring high in the hills and grows wider with every mile.",
            "Near the old mill the water runs fast and clear over smooth brown stones.",
            "In spring the river rises and spreads across the meadows on both banks.",
            "Boats carried grain and timber down the river to the towns on the coast.",
            "A stone bridge with seven arches crosses the river at the center of the city.",
            "Willows lean over the water and trail their branches in the current.",
            "Children skip flat stones across the shallow pools below the weir.",
            "The river Alder meets the river Brenn just north of the market town.",
            "At dusk the surface of the river turns the color of copper.",
            "The ferry crosses the river every half hour from dawn until late evening.",
            "Herons stand in the shallows and wait for small fish to swim past.",
            "Where the river reaches the sea, the water turns brown with silt.",
            "The canal runs beside the river for twelve miles and has nine locks.",
            "In a dry summer the river shrinks to a narrow stream between wide banks of pebbles.",
        ],
        [
            "The river", "The narrow stream", "The slow brown river", "The mountain brook", "The wide estuary",
            "The river Alder", "The river Brenn", "The old canal", "The cold creek", "The broad river",
        ],
        [
            "winds through the green valley", "flows past the old mill", "runs under the stone bridge",
            "turns east below the town", "carries leaves toward the sea", "spreads into a quiet lake",
            "falls over a low weir", "bends around the wooded hill", "passes the ferry landing",
            "feeds the fields along its banks", "reflects the evening sky", "divides the city into two halves",
        ],
        [
            "in early spring", "after the heavy rains", "on its way to the sea", "for many miles",
            "beneath the willows", "through the long summer", "near the market town", "at the edge of the forest",
        ],
    ),
    (
        "cities",
        [
            "The city grew up around a market where two roads and a river met.",
            "Its oldest street is narrow and crooked, and the houses lean toward each other above it.",
            "Every morning the trams begin running before the bakeries open.",
            "The library stands on the main square, across from the town hall and the fountain.",
            "On market days the square fills with stalls selling apples, cheese, cloth, and pots.",
            "At night the lamps along the harbor wall are reflected in the dark water.",
            "The new district has wide avenues, tall towers of glass, and small parks between them.",
            "A clock tower rises above the station, and its bell can be heard across the whole city.",
            "The city of Larnmouth has eleven bridges and more than forty churches.",
            "Many of the houses near the port were built by sailors and merchants long ago.",
            "The museum keeps maps of the city from every century since it was founded.",
            "Buses leave the central station every few minutes for the suburbs and the airport.",
            "In the evening people walk along the river and sit outside the cafes.",
            "The old city walls have been turned into a long garden with a path on top.",
        ],
        [
            "The old town", "The harbor district", "The main square", "The central station", "The city of Larnmouth",
            "The busy market", "The northern suburb", "The town hall", "The narrow lane", "The university quarter",
            "The city park", "The river district",
        ],
        [
            "was crowded with travelers", "grew quiet after midnight", "was rebuilt after the great fire",
            "filled with music and voices", "lay under a thin layer of snow", "was lit by rows of yellow lamps",
            "woke slowly to the sound of carts", "welcomed visitors from the coast", "was full of small shops",
            "smelled of bread and coffee", "stood empty on the holiday", "was decorated with flags",
        ],
        [
            "on the first day of the fair", "every Saturday morning", "during the winter festival",
            "after the last train had gone", "in the summer months", "for the rest of the week",
            "as the ships came in", "long before the bridge was built",
        ],
    ),
    (
        "tools",
        [
            "A good hammer has a heavy head and a handle made of ash or hickory.",
            "The carpenter measured the board twice and cut it once.",
            "A sharp chisel removes thin shavings of wood without tearing the grain.",
            "The blacksmith heated the iron until it glowed orange and then shaped it on the anvil.",
            "A spirit level shows whether a shelf is straight by the position of a small bubble.",
            "The saw has fine teeth for cutting across the grain and coarse teeth for cutting along it.",
            "Screwdrivers come in many sizes, and each one should fit the head of the screw exactly.",
            "The workshop smelled of oil, sawdust, and hot metal.",
            "A plane smooths the surface of a board until it shines.",
            "Before the lathe was invented, round table legs were shaped slowly by hand.",
            "The gardener cleaned and oiled his spade before putting it away for the winter.",
            "A wrench turns a nut, and a longer handle makes the work easier.",
            "Every tool in the shop hangs on the wall in its own marked place.",
            "The old clockmaker used tweezers, a loupe, and a set of tiny brass files.",
        ],
        [
            "The carpenter", "The blacksmith", "The old gardener", "The young apprentice", "The stone mason",
            "The clockmaker", "The shipwright", "The mechanic", "The potter", "The cooper", "The locksmith",
            "The weaver",
        ],
        [
            "sharpened the knives", "repaired the broken handle", "cleaned every tool on the bench",
            "measured the doorway with a folding rule", "oiled the hinges of the gate", "swept the floor of the shop",
            "tightened the loose bolts", "sorted the nails by size", "mended the wheel of the cart",
            "hung the tools back on the wall", "wrote a list of orders", "lit the lamp above the bench",
        ],
        [
            "in the workshop", "before the customers arrived", "by the light of the window", "with great care",
            "on a quiet afternoon", "for the third time", "before supper", "while the kettle boiled",
        ],
    ),
    (
        "animals",
        [
            "The fox crossed the field at dawn and disappeared into the hedge.",
            "Cows stood together under the oak tree while the rain passed.",
            "A pair of swallows built a nest of mud under the eaves of the barn.",
            "The old dog sleeps by the stove and wakes only when someone opens the door.",
            "Bees visit the clover in the morning and the lime trees in the afternoon.",
            "A hare can run faster than most dogs and turn sharply without slowing down.",
            "The owl hunts at night, flying so softly that mice rarely hear it coming.",
            "Sheep were moved to the high pastures at the beginning of summer.",
            "A small brown wren sang from the top of the woodpile.",
            "The cat watched the goldfish for an hour without moving its tail.",
            "Otters live along the quieter stretches of the river and are seldom seen.",
            "The horse knew the way home even in the dark.",
            "Geese fly south in long lines and call to each other as they go.",
            "A family of badgers has lived under the old beech for many years.",
        ],
        [
            "The red fox", "A grey heron", "The old dog", "A young deer", "The barn owl", "A pair of swans",
            "The brown hare", "A flock of starlings", "The farm cat", "A black horse", "The shy otter",
            "A small wren", "The goat", "A family of ducks",
        ],
        [
            "waited at the edge of the reeds", "crossed the meadow", "rested in the shade of the hedge",
            "watched the path from the hill", "drank from the cold stream", "slept in the warm straw",
            "searched the field for food", "followed the line of the fence", "hid among the tall ferns",
            "stood still in the long grass", "wandered along the river bank", "rested by the old wall",
        ],
        [
            "at first light", "in the evening", "after the storm", "while the village slept", "on a frosty morning",
            "late in the summer", "as the sun went down", "without making a sound",
        ],
    ),
    (
        "numbers",
        [
            "A week has seven days, and a year has twelve months.",
            "There are sixty minutes in an hour and sixty seconds in a minute.",
            "An even number can be divided by two without a remainder.",
            "The first few prime numbers are two, three, five, seven, and eleven.",
            "A dozen eggs is twelve eggs, and half a dozen is six.",
            "A triangle has three sides, a square has four, and a hexagon has six.",
            "If you double a number and then halve it, you return to where you started.",
            "Counting by tens, the baker stacked one hundred loaves on the shelves.",
            "The train left at 7 in the morning and arrived at 11 before noon.",
            "The road to the coast is 42 miles long and climbs over two passes.",
            "The old map shows 3 wells, 5 farms, and 1 mill along the valley.",
            "Zero is neither positive nor negative.",
            "Any number multiplied by one stays the same.",
            "The sum of the angles in a triangle is always one hundred and eighty degrees.",
        ],
        [],
        [],
        [],
    ),
    (
        "plants",
        [
            "The apple trees blossom in April, and the petals fall like snow in May.",
            "Tomatoes need warm soil, plenty of water, and a sunny wall to ripen well.",
            "The oak grows slowly but can live for several hundred years.",
            "Moss covers the north side of the stones in the shady part of the wood.",
            "In autumn the maples turn red and gold before they drop their leaves.",
            "Beans climb the poles and twist around them as they grow.",
            "A hedge of hawthorn keeps the sheep in and the wind out.",
            "The seeds were sown in rows and covered with a thin layer of fine soil.",
            "Lavender grows best in dry ground and fills the garden with its scent.",
            "Ferns unroll their new leaves slowly in the damp spring air.",
            "The vines on the southern slope gave a good harvest this year.",
            "Wild strawberries grow along the edge of the path where the light is good.",
            "Potatoes are planted in spring and dug up at the end of summer.",
            "The roots of the old elm have lifted the paving stones of the lane.",
        ],
        [
            "The apple tree", "The cherry tree", "The plum tree", "The rose bush", "The lilac", "The quince",
            "The old pear tree", "The hawthorn hedge", "The lime tree", "The young almond tree",
        ],
        [
            "grew quickly in the warm soil", "came into flower", "needed water", "stood against the blue sky",
            "was covered in bright blossom", "survived the long winter", "shaded the bench",
            "was full of bees", "turned toward the light", "dropped its petals on the path",
        ],
        [
            "in early May", "by the end of the summer", "after the first warm rain", "along the southern wall",
            "behind the cottage", "in the corner of the field", "every year", "despite the cold nights",
        ],
    ),
    (
        "kitchen",
        [
            "The baker lit the oven long before sunrise.",
            "Bread is made from flour, water, salt, and yeast, and it needs time to rise.",
            "The soup simmered on the stove all afternoon and filled the house with its smell.",
            "She cut the onions thinly and fried them slowly until they were soft and sweet.",
            "A pot of tea was kept warm under a woolen cover on the table.",
            "The apples were peeled, sliced, and baked with butter and a little sugar.",
            "Fresh herbs hung in bunches from a beam above the kitchen window.",
            "The cook tasted the sauce and added a pinch of salt.",
            "Plates, cups, and bowls were stacked neatly on the wooden shelves.",
            "In the cellar there were jars of jam, barrels of apples, and sacks of potatoes.",
            "The kettle whistled, and someone took it off the heat.",
            "Rice should be rinsed before cooking so that the grains do not stick together.",
            "They ate supper at a long table in the garden while the sun went down.",
            "The smell of warm bread drifted out into the street.",
        ],
        [
            "The baker", "The cook", "Grandmother", "The young chef", "The innkeeper", "My neighbor", "The farmer",
            "The kitchen maid", "Our host", "The miller",
        ],
        [
            "baked a loaf of brown bread", "made a pot of vegetable soup", "sliced the cheese", "boiled the potatoes",
            "set the table for eight", "roasted a chicken with herbs", "poured the tea", "stirred the porridge",
            "washed the dishes", "picked beans for supper", "made apple pie", "ground the coffee",
        ],
        [
            "before the guests arrived", "early in the morning", "for the harvest feast", "on Sunday",
            "while the children played outside", "in the old iron pan", "with flour from the mill",
            "as the rain fell",
        ],
    ),
    (
        "sea",
        [
            "The ship left the harbor at high tide with a full cargo of salt and wool.",
            "Waves broke against the rocks and threw spray high into the air.",
            "The fishermen mended their nets on the quay while the gulls watched.",
            "At low tide you can walk across the sand to the small island.",
            "The lighthouse keeper climbed the stairs each evening to light the lamp.",
            "A sailor learns to read the sky, the water, and the wind.",
            "The anchor held through the storm, and in the morning the sea was calm.",
            "Small boats with red sails raced each other across the bay.",
            "Shells and smooth pieces of glass lay along the line of the last tide.",
            "The captain checked the charts and set a course for the northern cape.",
            "Far out at sea the water is deep blue and very cold.",
            "The harbor wall was built of huge blocks of granite.",
            "A seal lifted its head out of the water and looked at the boat.",
            "The tide comes in twice a day and covers the flat sands.",
        ],
        [
            "The fishing boat", "The old schooner", "The ferry", "The cargo ship", "The small yacht",
            "The lifeboat", "The steamer", "The rowing boat", "The lighthouse tender", "The whaler",
        ],
        [
            "sailed out of the harbor", "returned with a full hold", "rounded the northern cape",
            "anchored in the quiet bay", "waited for the tide", "crossed the open sea",
            "rode out the storm", "tied up at the quay", "followed the coast south", "raised its sails",
            "struggled against the current", "carried passengers to the islands",
        ],
        [
            "at high tide", "before the storm", "in the grey light of dawn", "under a clear sky",
            "with the wind behind it", "late in the evening", "after a long voyage", "in calm weather",
        ],
    ),
    (
        "mountains",
        [
            "The path climbs through pine forest before it reaches the open slopes.",
            "Snow stays on the highest peaks even in the middle of summer.",
            "From the summit you can see three valleys and a distant lake.",
            "The climbers started before dawn so that they could return before the afternoon storms.",
            "A stone hut stands below the pass, with room for twelve travelers.",
            "The air grows thin and cold as the road winds higher.",
            "Goats graze on ledges that look impossible to reach.",
            "Glaciers move slowly down the valleys and grind the rock beneath them.",
            "The mountain village has a church, an inn, and a small school.",
            "Streams from the melting snow rush down the gullies in June.",
            "The guide tested each step on the ice with the point of his axe.",
            "At sunset the western faces of the mountains glow pink and orange.",
            "An old mule track leads over the ridge to the next valley.",
            "Clouds can hide the summit for days at a time.",
        ],
        [
            "The climbers", "The shepherd", "The mountain guide", "The two walkers", "The surveyor",
            "The old hermit", "A group of students", "The mule driver", "The ranger", "The painter",
        ],
        [
            "reached the summit", "crossed the high pass", "rested at the stone hut", "followed the ridge",
            "climbed the steep path", "watched the clouds gather", "descended into the valley",
            "found shelter from the wind", "drank from a mountain spring", "studied the map",
            "waited for the fog to lift", "walked along the edge of the glacier",
        ],
        [
            "before noon", "in the afternoon", "on the second day", "at sunrise", "despite the cold",
            "in thick fog", "after a long climb", "just before the storm",
        ],
    ),
    (
        "seasons",
        [
            "Spring arrives slowly in the north, and the last snow melts only in May.",
            "In summer the days are long, and it is still light at ten in the evening.",
            "Autumn brings the harvest, the first fires, and the smell of fallen leaves.",
            "Winter is the quiet season, when the fields rest and the nights are long.",
            "Each season has its own work on a farm, from sowing to harvest to repair.",
            "The first warm day of spring brings everyone out into the streets.",
            "Children wait all year for the first heavy snow of winter.",
            "The orchards are busiest in autumn when the apples and pears are picked.",
            "Midsummer is celebrated with music, bonfires, and dancing in the square.",
            "By the end of winter the woodpile is small and the larder is nearly empty.",
            "The days grow shorter after the equinox, and the evenings grow cooler.",
            "In spring the lambs are born and the swallows return from the south.",
        ],
        [
            "Spring", "Summer", "Autumn", "Winter", "The long summer", "The early spring", "The late autumn",
            "The hard winter",
        ],
        [
            "came early that year", "brought rain to the valley", "was warm and dry", "lasted longer than usual",
            "filled the barns with hay", "turned the hills golden", "kept everyone indoors",
            "brought the birds back", "ended with a great storm", "was remembered for many years",
        ],
        [
            "in the northern villages", "across the whole country", "along the coast", "in the high valleys",
            "for the farmers", "in our town",
        ],
    ),
    (
        "crafts",
        [
            "The weaver sat at her loom and worked a pattern of blue and white squares.",
            "A potter shapes wet clay on a spinning wheel and fires it in a kiln.",
            "The bookbinder folded the pages, sewed them together, and covered them in leather.",
            "Glass is made from sand heated until it melts and can be blown into shapes.",
            "The tailor measured the shoulders, the arms, and the length of the coat.",
            "Baskets were woven from willow rods that had been soaked in water.",
            "The cobbler repaired the soles of the boots with new leather and small nails.",
            "Candles were made by dipping wicks again and again into warm wax.",
            "The printer set each line of type by hand and inked it with a roller.",
            "A good rope is made of many thin fibers twisted tightly together.",
            "The dyer used onion skins for yellow, madder root for red, and woad for blue.",
            "The jeweler set a small green stone in a ring of silver.",
        ],
        [
            "The weaver", "The potter", "The bookbinder", "The glassblower", "The tailor", "The basket maker",
            "The cobbler", "The printer", "The rope maker", "The dyer", "The jeweler", "The candle maker",
        ],
        [
            "finished a large order", "opened a new shop on the square", "taught the craft to an apprentice",
            "worked late into the night", "sold everything at the fair", "tried a new pattern",
            "bought fresh materials", "repaired an old piece", "showed the work to visitors",
            "made a gift for the mayor", "kept careful notes", "cleaned the workshop",
        ],
        [
            "last week", "before the winter", "in a single day", "for the spring market", "with steady hands",
            "after many attempts", "in the back room", "by candlelight",
        ],
    ),
    (
        "travel",
        [
            "The road follows the river for a while and then climbs into the hills.",
            "Travelers used to stop at the inn to change horses and eat a hot meal.",
            "The night train crosses the border a little after midnight.",
            "A signpost at the crossroads points to four towns and a lighthouse.",
            "We packed bread, cheese, apples, and a map before setting out.",
            "The journey took three days by cart and only two hours by train.",
            "The bridge was closed, so the coach had to go the long way around the lake.",
            "Pilgrims walked the old road from one chapel to the next.",
            "The station master waved his flag, and the train began to move.",
            "At the top of the hill the travelers stopped to look back at the town.",
            "The postman rides his bicycle along the lanes in every kind of weather.",
            "A narrow path runs along the cliff above the beach.",
        ],
        [
            "The coach", "The night train", "The postman", "The traveler", "The old cart", "The pilgrim",
            "The family", "The merchant", "The soldier", "The tired walker",
        ],
        [
            "left the inn", "reached the crossroads", "crossed the border", "followed the old road",
            "stopped at the station", "arrived in the town", "took the path along the cliff",
            "turned toward the coast", "rested by the well", "passed the last farm",
        ],
        [
            "at dawn", "late in the evening", "on the third day", "in the rain", "after a long delay",
            "before the gates closed", "with a heavy pack", "just after noon",
        ],
    ),
    (
        "sky",
        [
            "On a clear night far from the town, thousands of stars can be seen.",
            "The moon rose over the hill, large and orange, and grew paler as it climbed.",
            "Sailors once found their way by the stars that never set.",
            "The sun rises in the east and sets in the west.",
            "A comet was seen for several weeks, with a long pale tail.",
            "The evening star appears in the west soon after sunset.",
            "During the eclipse the birds fell silent and the air grew cool.",
            "Clouds of many shapes drifted across the afternoon sky.",
            "The old astronomer kept a notebook of every night he watched the planets.",
            "Meteors streak across the sky in August, a few every hour.",
            "The sky over the sea turned from gold to violet to deep blue.",
            "A telescope on the roof of the school lets the pupils look at the craters of the moon.",
        ],
        [
            "The full moon", "The evening star", "The planet Venus", "A bright comet", "The northern lights",
            "The crescent moon", "The pale moon", "The red planet",
        ],
        [
            "rose above the trees", "shone on the water", "lit the whole valley", "appeared over the hills",
            "sank behind the mountains", "glowed in the western sky", "was reflected in the lake",
            "hung low over the sea", "disappeared behind the clouds", "filled the sky with color",
        ],
        [
            "that night", "for a few minutes", "as the town fell asleep", "in the cold air", "soon after supper",
            "on the longest day", "at the end of the year", "while the fishermen watched",
        ],
    ),
    (
        "school",
        [
            "The school bell rings at eight, and the pupils line up in the yard.",
            "The teacher wrote the date on the blackboard in neat white letters.",
            "Every child has a slate, a pencil, and a small book of sums.",
            "In the afternoon the class walked to the river to draw the bridge.",
            "The library has shelves from the floor to the ceiling and a ladder on wheels.",
            "A good book can be read many times and still surprise the reader.",
            "The students studied the map of the world and named the oceans.",
            "The old librarian knew where every book in the building was kept.",
            "Reading aloud helps children learn new words and hear how sentences sound.",
            "The schoolhouse has one large room, a stove, and a garden behind it.",
            "The pupils planted beans in jars to watch the roots grow.",
            "At the end of the year there is a small fair with songs and games.",
        ],
        [
            "The teacher", "The pupils", "The old librarian", "The young student", "The head of the school",
            "The reading group", "The new class", "The music teacher",
        ],
        [
            "read a story about the sea", "copied the lesson from the board", "sang a song about the river",
            "drew a map of the village", "counted the books in the library", "learned the names of the stars",
            "wrote a letter to the mayor", "planted a tree in the yard", "practiced their sums",
            "visited the museum",
        ],
        [
            "in the morning", "after lunch", "on the last day of term", "with great interest", "before the bell",
            "in the library", "while it rained outside", "for the spring fair",
        ],
    ),
    (
        "music",
        [
            "The band played in the square every Sunday afternoon in summer.",
            "A violin has four strings and is played with a bow made of horsehair.",
            "The church choir practiced on Thursday evenings in the cold nave.",
            "The old piano in the parlor was slightly out of tune, but nobody minded.",
            "A drum kept the rhythm while the flutes played the tune.",
            "The fiddler played so fast that the dancers could hardly keep up.",
            "Bells rang from every tower in the city at noon on the holiday.",
            "The song was simple, and everyone in the room knew the words.",
            "A music box on the shelf played a short waltz when its lid was opened.",
            "Singing on the long walk home made the miles pass quickly.",
        ],
        [
            "The band", "The choir", "The fiddler", "The old organist", "The young pianist", "The singers",
            "The drummer", "The street musician",
        ],
        [
            "played a lively tune", "sang an old song", "practiced for the festival", "performed in the square",
            "played until midnight", "learned a new melody", "filled the hall with music",
            "played for the dancers",
        ],
        [
            "on Sunday afternoon", "at the wedding", "in the village hall", "under the old lime tree",
            "for the harvest festival", "by the harbor", "on the last night of summer",
        ],
    ),
    (
        "forest",
        [
            "The forest is darkest in the middle of the day, when the leaves are thickest.",
            "A woodcutter's path winds between the beeches and ends at a clearing with a spring.",
            "Mushrooms appear after the autumn rains, brown and yellow among the fallen needles.",
            "The oldest trees in the wood are hollow, and owls and bats live inside them.",
            "Sunlight falls through gaps in the canopy and makes bright patches on the ground.",
            "In winter you can follow the tracks of deer, foxes, and hares in the snow.",
            "The forester marks the trees that will be cut with a stripe of white paint.",
            "Woodpeckers drum on dead branches to mark their territory in spring.",
            "Blackberries grow thickly where the old road enters the wood.",
            "Under the pines the ground is soft, quiet, and smells of resin.",
            "A charcoal burner once lived in a hut at the edge of the forest.",
            "The stream through the wood is lined with moss, ferns, and roots.",
        ],
        [
            "The forester", "The woodcutter", "A lost traveler", "The hunter", "The charcoal burner",
            "A group of children", "The botanist", "The old warden",
        ],
        [
            "walked under the tall beeches", "followed the deer tracks", "gathered mushrooms",
            "found the clearing with the spring", "marked the old oaks", "stacked the firewood",
            "listened to the woodpecker", "crossed the mossy stream", "picked blackberries by the road",
            "rested beneath the pines",
        ],
        [
            "in the early morning", "after the autumn rains", "deep in the forest", "until the light faded",
            "on a misty day", "in the middle of winter", "before the hunting season", "with a basket",
        ],
    ),
    (
        "houses",
        [
            "The cottage has thick stone walls, a slate roof, and a blue front door.",
            "A fire burned in the hearth, and the kettle hung on a hook above it.",
            "The house was painted white every spring to keep out the damp.",
            "Roses grew around the door, and a bench stood under the window.",
            "The attic was full of trunks, old chairs, and boxes of letters.",
            "From the kitchen window you could see the whole valley.",
            "The farmhouse kitchen had a stone floor and a long wooden table.",
            "Shutters were closed at night to keep the warmth inside.",
            "The staircase creaked on the third step and on the seventh.",
            "A small garden behind the house grew lettuce, carrots, and onions.",
            "The builders laid the foundations before the autumn rain began.",
            "The windows were cleaned, the floors were swept, and the house was ready for guests.",
        ],
        [
            "The cottage", "The old farmhouse", "The house by the river", "The tall narrow house",
            "The stone barn", "The inn", "The mill house", "The white villa", "The school house",
        ],
        [
            "was warm and bright", "needed a new roof", "stood at the end of the lane", "was sold to a young family",
            "had a garden full of roses", "was painted blue", "smelled of wood smoke", "was empty for many years",
            "looked over the harbor", "was built of grey stone",
        ],
        [
            "in those days", "after the war", "when we were children", "for a long time", "in the spring",
            "by the time we arrived",
        ],
    ),
    (
        "market",
        [
            "The market opens at six, and the best fruit is gone by nine.",
            "Farmers bring eggs, butter, and vegetables to town in carts and vans.",
            "The fishmonger calls out the prices of herring, cod, and mackerel.",
            "A woman sells honey in small jars with paper labels.",
            "Coins and notes change hands quickly as the morning goes on.",
            "The cheese stall has round wheels of cheese stacked as high as a person.",
            "Children buy sweets with the coins they have saved all week.",
            "At the end of the day the traders pack their goods and sweep the square.",
            "Prices were high that winter because the harvest had been poor.",
            "A man with a barrow sells hot chestnuts on cold evenings.",
            "The flower seller wraps each bunch in brown paper and string.",
            "The scales on the grocer's counter are checked by the inspector every year.",
        ],
        [
            "The fishmonger", "The grocer", "The flower seller", "The cheese maker", "The honey seller",
            "The old trader", "The butcher", "The fruit seller", "The bookseller", "The spice merchant",
        ],
        [
            "sold everything before noon", "raised the prices", "set up a stall by the fountain",
            "counted the coins", "packed up early", "weighed the goods on the scales", "called out to the crowd",
            "gave a discount to the regular customers", "arrived late with a full cart", "wrapped the orders",
        ],
        [
            "on market day", "in the cold morning", "as the crowd grew", "before the rain came",
            "at the end of the day", "during the fair", "every week",
        ],
    ),
    (
        "time",
        [
            "The church clock strikes every hour, and twice on the half hour.",
            "A sundial tells the time only when the sun is shining.",
            "An hourglass was turned over at the start of every watch on the ship.",
            "The watchmaker wound each clock in the shop on Monday mornings.",
            "Time seems to move slowly on a long journey and quickly on a holiday.",
            "The calendar on the kitchen wall showed the phases of the moon.",
            "Farmers once measured the year by the planting, the harvest, and the feasts.",
            "The town hall clock was ten minutes fast for most of the year.",
            "At midnight the year changes, and the bells ring out across the town.",
            "A candle marked with lines can measure the hours of the night.",
            "The old station clock has a face as large as a cart wheel.",
            "Morning, noon, evening, and night each have their own sounds in the village.",
        ],
        [
            "The church clock", "The station clock", "The old sundial", "The grandfather clock",
            "The clock in the hall", "The watchmaker", "The bell in the tower", "The ship's bell",
        ],
        [
            "struck twelve", "stopped for an hour", "was set right again", "chimed softly", "rang the hour",
            "was wound by hand", "kept perfect time", "ran a little slow",
        ],
        [
            "at noon", "at midnight", "on New Year's Eve", "every Sunday", "after the repair",
            "during the storm", "for many years",
        ],
    ),
]

_NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
]
# fmt: on


def _number_sentences(rng: random.Random, count: int) -> list[str]:
    """Arithmetic facts in words, correct by construction."""
    out: list[str] = []
    while len(out) < count:
        kind = rng.randrange(5)
        a, b = rng.randrange(1, 11), rng.randrange(1, 11)
        if kind == 0:
            s = f"{_NUMBER_WORDS[a].capitalize()} and {_NUMBER_WORDS[b]} make {_NUMBER_WORDS[a + b]}."
        elif kind == 1 and a + b <= 20:
            s = f"{_NUMBER_WORDS[a + b].capitalize()} minus {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a]}."
        elif kind == 2 and 2 * a <= 20:
            s = f"{_NUMBER_WORDS[2 * a].capitalize()} is twice {_NUMBER_WORDS[a]}."
        elif kind == 3 and a < 20:
            s = f"The number {_NUMBER_WORDS[a + 1]} comes after {_NUMBER_WORDS[a]}."
        elif kind == 4 and a * b <= 20:
            s = f"{_NUMBER_WORDS[a].capitalize()} times {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a * b]}."
        else:
            continue
        if s not in out:
            out.append(s)
    return out


def _template_sentences(
    rng: random.Random, subjects: list[str], predicates: list[str], endings: list[str], count: int
) -> list[str]:
    out: list[str] = []
    attempts = 0
    while len(out) < count and attempts < count * 20:
        attempts += 1
        sentence = f"{rng.choice(subjects)} {rng.choice(predicates)}"
        if rng.random() < 0.7:
            sentence += f" {rng.choice(endings)}"
        sentence += "."
        if sentence not in out:
            out.append(sentence)
    return out


def corpus_sections() -> list[list[str]]:
    """The corpus as topics of sentences (deterministic: a fixed seed drives the templates)."""
    rng = random.Random(SEED)
    sections: list[list[str]] = []
    for name, hand, subjects, predicates, endings in TOPICS:
        if name == "numbers":
            generated = _number_sentences(rng, TEMPLATE_SENTENCES_PER_TOPIC)
        else:
            generated = _template_sentences(rng, subjects, predicates, endings, TEMPLATE_SENTENCES_PER_TOPIC)
        sentences = list(hand) + [s for s in generated if s not in hand]
        rng.shuffle(sentences)
        sections.append(sentences)
    return sections


def corpus_text() -> str:
    """``corpus.txt``: one sentence per line, a blank line between topics."""
    return "\n\n".join("\n".join(section) for section in corpus_sections()) + "\n"


def train_tokenizer(corpus: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in corpus.splitlines() if line]
    # Train on each sentence both at the start of a text and after a space, the two forms the text model emits.
    tokenizer.train_from_iterator(lines + [" " + line for line in lines], trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"token {token!r} is not in the vocabulary")
    return int(token_id)


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def build(out_dir: Path) -> list[Path]:
    """Write the model directory into ``out_dir`` (created if missing; files overwritten). Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = corpus_text()
    tokenizer = train_tokenizer(corpus)
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    bos_id, eos_id, im_end_id = (_token_id(tokenizer, t) for t in (BOS, EOS, IM_END))
    files = {
        "corpus.txt": corpus,
        "tokenizer.json": str(tokenizer.to_str(pretty=False)) + "\n",
        "tokenizer_config.json": _json(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": UNK,
                "pad_token": EOS,
                "additional_special_tokens": [IM_START, IM_END],
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": MAX_POSITION_EMBEDDINGS,
                "chat_template": CHAT_TEMPLATE,
            }
        ),
        "config.json": _json(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab_size,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
                "hidden_act": "silu",
                "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
                "rms_norm_eps": 1e-06,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "torch_dtype": "float16",
                "bos_token_id": bos_id,
                "eos_token_id": eos_id,
            }
        ),
        "generation_config.json": _json({"bos_token_id": bos_id, "eos_token_id": [eos_id, im_end_id]}),
    }
    written: list[Path] = []
    for name, text in files.items():
        path = out_dir / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(text.encode("utf-8"))
        tmp.replace(path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out-dir", type=Path, default=MODEL_DIR, help=f"[{MODEL_DIR}]")
    args = parser.parse_args(argv)
    for path in build(args.out_dir):
        print(f"{path.stat().st_size:>8}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
